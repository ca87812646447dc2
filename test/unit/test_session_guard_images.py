"""Patch session-guard remembers a session's context at release; with an image in
the prompt that context holds the image's pad values (>= 1e6, up to 2^62 for wide
pads), which an int32 array cannot hold: the scheduler died with OverflowError
(found by test/e2e/test_openai_client.py, an image at turn 4 of a session)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang_l3.patches.sessions import session_guard


class _Cache:
    """A tree cache stand-in (weak-referenceable, as the real one)."""


class _Registry:
    """The only registry method _on_release reads (the store's registry needs a store)."""

    def is_open(self, sid: str) -> bool:
        return True


def test_release_of_a_session_request_with_image_pads(monkeypatch) -> None:
    item = MultimodalDataItem(modality=Modality.IMAGE, feature=None)
    item.set_hash(2**64 - 12345)  # the server's hashes span 64 bits
    pads = list(item.padding_values())
    assert max(pads) >= 2**31  # the premise: an image pad does not fit int32
    req = Req("r", "", array("q", [1, 2, *pads, 3]), SamplingParams(), session_id="agent")
    req.output_ids = [7]
    req.finished_reason = SimpleNamespace()  # finished, not aborted
    cache = _Cache()
    monkeypatch.setattr(session_guard, "registry_of", lambda c: _Registry())
    session_guard._on_release(None, cache, req)
    assert list(session_guard.contexts_of(cache)["agent"].tokens) == [1, 2, *pads, 3, 7]
