"""Issue 49: every per-session context held in memory is bounded in bytes, in both
processes. The HTTP process's hint book (`sessions.hints.BOOK.contexts`) and each
scheduler rank's session-guard book keep 4 bytes a token (an int list took ~36) and
forget their least recently stored contexts past a byte budget, not only past a number
of sessions (4,096 x 256K-token int lists was ~40 GB)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang_l3.patches.sessions import session_guard
from sglang_l3.sessions.contexts import ContextBook, tokens_array
from sglang_l3.sessions.hints import HintBook

K256 = 256 * 1024


def test_two_256k_agents_take_2_mib_in_the_hint_book() -> None:
    book = HintBook()
    for sid in ("agent-a", "agent-b"):
        book.remember(sid, list(range(K256)))
    assert book.contexts.nbytes == 2 * K256 * 4 == 2 * 2**20
    assert book.contexts.get("agent-a")[:3] == [0, 1, 2] and len(book.contexts) == 2
    book.forget("agent-a")
    assert "agent-a" not in book.contexts and book.contexts.nbytes == K256 * 4


def test_the_book_forgets_the_oldest_past_its_byte_budget() -> None:
    book = ContextBook(max_entries=1024, max_bytes=10 * 4000)
    for i in range(1024):  # 1,024 sessions of 1,000 tokens: 4 MB, over a 40 KB budget
        book.put(f"s{i}", range(i, i + 1000))
        assert book.nbytes <= book.max_bytes
    assert len(book) == 10 and list(book) == [f"s{i}" for i in range(1014, 1024)]
    book.put("huge", range(20_000))  # larger than the whole budget: not kept, nothing evicted
    assert "huge" not in book and len(book) == 10
    book.put("s1014", range(5))  # a new context of a session replaces its old one
    assert book.get("s1014") == [0, 1, 2, 3, 4] and list(book)[-1] == "s1014"


def test_ids_beyond_32_bits_keep_8_bytes() -> None:
    assert tokens_array([1, 2]).itemsize == 4
    assert tokens_array([1, 2**40]).itemsize == 8 and list(tokens_array([1, 2**40])) == [1, 2**40]


class _Cache:
    """A tree cache stand-in (weak-referenceable, as the real one)."""


def test_the_session_guard_book_is_bounded_in_bytes(monkeypatch) -> None:
    monkeypatch.setattr(session_guard, "registry_of", lambda c: SimpleNamespace(is_open=lambda sid: True))
    monkeypatch.setattr(session_guard, "MAX_CONTEXT_BYTES", 3 * 4 * 1000)
    cache = _Cache()
    for i in range(5):
        req = Req(f"r{i}", "", array("q", range(999)), SamplingParams(), session_id=f"agent-{i}")
        req.output_ids = [7]
        req.finished_reason = SimpleNamespace()  # finished, not aborted
        session_guard._on_release(None, cache, req)
    book = session_guard.contexts_of(cache)
    assert list(book) == ["agent-2", "agent-3", "agent-4"]
    assert all(c.tokens.itemsize == 4 and len(c.tokens) == 1000 for c in book.values())
