"""The "speaks next" hint book (issue 13, stage 3), without a server: input
checks, de-duplication of identical hints, requests joining an in-flight hint.
(The server test drives it through upstream's TokenizerManager.)"""

from __future__ import annotations

import asyncio

import pytest
from sglang_l3.patches import framework
from sglang_l3.sessions.hints import (
    DEFERRED_DEVICE_FULL,
    HINT_RID_PREFIX,
    HINT_SAMPLING_PARAMS,
    HintBook,
    HintError,
    hint_rid,
    hint_session,
    request_ids_and_session,
)


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Scheduler:
    """Stands in for TokenizerManager.generate_request: answers each request
    when the test releases it, with the metadata upstream returns."""

    def __init__(self):
        self.release = asyncio.Event()
        self.seen = []

    async def generate_request(self, obj, request=None):
        self.seen.append(obj)
        await self.release.wait()
        yield {
            "meta_info": {
                "cached_tokens": 128,
                "cached_tokens_details": {"storage": 128},
                "finish_reason": {"type": "length"},
            }
        }


def test_validation_gives_clear_answers():
    book = HintBook()
    for body, status in (
        ([], 400),
        ({}, 400),
        ({"session_id": ""}, 400),
        ({"session_id": "x"}, 404),
        ({"input_ids": []}, 400),
        ({"input_ids": [1, "a"]}, 400),
        ({"input_ids": [True]}, 400),
        ({"input_ids": [5, 1000]}, 400),
        ({"input_ids": list(range(10))}, 400),
    ):
        with pytest.raises(HintError) as e:
            book.validate(body, vocab_size=1000, context_len=8)
        assert e.value.status == status, body
    book.remember("s", [1, 2, 3])
    assert book.validate({"session_id": "s"}, 1000, 8) == ([1, 2, 3], "s")
    assert book.validate({"session_id": "s", "input_ids": [4]}, 1000, 8) == ([4], "s")


def test_identical_hints_run_once_and_requests_join():
    async def main():
        book, sched = HintBook(), _Scheduler()
        h1, created1 = book.start(sched, [1, 2, 3, 4], "s")
        h2, created2 = book.start(sched, [1, 2, 3, 4], None)
        assert created1 and not created2 and h1 is h2
        await asyncio.sleep(0)
        assert [o.rid for o in sched.seen] == [h1.id] and h1.id.startswith(HINT_RID_PREFIX)
        assert sched.seen[0].sampling_params == HINT_SAMPLING_PARAMS
        # a request extending the hinted context waits; an unrelated one does not
        assert book.covering([1, 2, 3, 4, 9], None) == [h1]
        assert book.covering([1, 2, 3], None) == [] and book.covering([7, 2, 3, 4, 5], None) == []
        assert book.covering(None, "s") == [h1]
        waiter = asyncio.create_task(book.join([1, 2, 3, 4, 5], None))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        sched.release.set()
        assert await asyncio.wait_for(waiter, 10) == 1
        assert h1.state == "landed" and h1.cached["storage"] == 128
        assert book.covering([1, 2, 3, 4, 5], None) == []
        h3, created3 = book.start(sched, [1, 2, 3, 4], "agent-a")  # landed: a new hint may run
        assert created3 and h3 is not h1 and hint_session(h3.id) == "agent-a"
        await asyncio.wait_for(h3.done.wait(), 10)

    asyncio.run(main())


def test_a_hint_is_a_greedy_row_whatever_the_server_prefers():
    """A hint shares batches with users' requests; upstream samples a batch greedily only
    when every row is greedy (`SamplingBatchInfo.is_all_greedy`: top_k <= 1), and keeps a
    running batch off that path once a sampled row was in it. The hint's parameters, with
    a server's `--preferred-sampling-params` filled in as TokenizerManager fills them
    (what the request sets wins), are a greedy row without filters or penalties (the
    server test, test_tp2_streamed_server.py, shows what a sampled hint changed)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    preferred = {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.05,
        "frequency_penalty": 0.1,
        "presence_penalty": 1.5,
        "repetition_penalty": 1.05,
    }
    sp = SamplingParams(**{**preferred, **HINT_SAMPLING_PARAMS})
    sp.verify(vocab_size=1024)
    assert sp.max_new_tokens == 0
    assert sp.top_k <= 1, sp.top_k  # is_all_greedy's test
    assert (sp.top_p, sp.min_p) == (1.0, 0.0)
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    # the control: the parameters a hint had before (upstream's defaults) are a sampled row
    assert SamplingParams(max_new_tokens=0).top_k > 1


def test_a_failing_hint_is_a_state():
    class Broken:
        async def generate_request(self, obj, request=None):
            raise RuntimeError("scheduler said no")
            yield  # pragma: no cover

    async def main():
        book = HintBook()
        h, _ = book.start(Broken(), [1, 2], None)
        await asyncio.wait_for(h.done.wait(), 10)
        assert h.state == "failed" and "scheduler said no" in h.error
        assert await book.join([1, 2, 3], None) == 0

    asyncio.run(main())


def test_a_hints_request_id_names_its_session():
    """The scheduler's guard learns the hinted session from the request id."""
    for sid in ("agent-a", "a-b-c", "ünï", "x" * 256):
        rid = hint_rid(sid)
        assert rid.startswith(HINT_RID_PREFIX) and hint_session(rid) == sid
    assert hint_session(hint_rid(None)) is None
    assert hint_session(HINT_RID_PREFIX + "abc-zz") is None  # not hex: no session
    assert hint_session("h1-6162") is None  # not a hint
    assert hint_session(None) is None


def test_a_hint_declined_by_the_guard_says_so():
    """The scheduler's guard (patch session-guard) answers with an abort whose
    message carries the marker: the hint's state is deferred_device_full."""

    class Guarded:
        async def generate_request(self, obj, request=None):
            yield {
                "meta_info": {
                    "cached_tokens": 0,
                    "finish_reason": {
                        "type": "abort",
                        "message": f"sglang-l3 hint {DEFERRED_DEVICE_FULL}: ... ['agent-a'] ...",
                    },
                }
            }

    async def main():
        book = HintBook()
        h, _ = book.start(Guarded(), [1, 2], None)
        await asyncio.wait_for(h.done.wait(), 10)
        assert h.state == DEFERRED_DEVICE_FULL and "agent-a" in h.error
        assert h.as_dict()["state"] == DEFERRED_DEVICE_FULL
        assert book.inflight() == []

    asyncio.run(main())


def test_request_ids_and_session():
    assert request_ids_and_session(_Obj(rid=HINT_RID_PREFIX + "x", input_ids=[1])) == (
        None,
        None,
        True,
    )
    assert request_ids_and_session(_Obj(rid="r", input_ids=[1, 2], session_id="a", session_params=None)) == (
        [1, 2],
        "a",
        False,
    )
    assert request_ids_and_session(_Obj(rid="r", input_ids=[[1]], session_id=None, session_params={"id": "b"})) == (
        None,
        "b",
        False,
    )


def test_patches_apply():
    for pid in ("sessions", "session-hints", "session-guard"):
        st = framework.get_status(pid)
        assert st is not None and st.state == framework.State.APPLIED, (
            pid,
            st and st.detail,
        )


def test_routes_answer_clearly(monkeypatch, tmp_path):
    """The routes on a FastAPI app, over a stand-in tokenizer manager (the
    server test drives them through upstream's)."""
    import sys
    import types

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang_l3.patches.sessions import session_hints as patch
    from sglang_l3.sessions.hints import BOOK

    class _TM(_Scheduler):
        def __init__(self):
            super().__init__()
            self.gracefully_exit = False
            self.model_config = _Obj(vocab_size=1000)
            self.context_len = 4096
            self.server_args = _Obj(
                hicache_storage_backend="file",
                hicache_storage_backend_extra_config=f'{{"store_dir": "{tmp_path}"}}',
            )
            self.release.set()

    tm = _TM()
    monkeypatch.setitem(
        sys.modules,
        patch.HTTP,
        types.SimpleNamespace(_global_state=types.SimpleNamespace(tokenizer_manager=tm)),
    )
    app = FastAPI()
    patch.add_routes(app)
    c = TestClient(app)
    assert c.post("/sglang_l3/prefetch", json={"session_id": "nobody"}).status_code == 404
    assert c.post("/sglang_l3/prefetch", content=b"{not json").status_code == 400
    assert c.post("/sglang_l3/prefetch", json={"input_ids": [1, 5000]}).status_code == 400
    r = c.post("/sglang_l3/prefetch", json={"input_ids": [1, 2, 3]})
    assert r.status_code == 202, r.text
    hid = r.json()["hint_id"]
    st = c.get(f"/sglang_l3/prefetch/{hid}").json()
    assert st["state"] in ("staging", "landed") and st["tokens"] == 3
    assert c.get("/sglang_l3/prefetch/nope").status_code == 404
    # issue 49: the listing scans pages/ (seconds for a large store) off the event loop
    import asyncio

    from sglang_l3.storage import index

    scans: list[bool] = []
    real_scan = index.scan

    def scan(root):
        try:
            asyncio.get_running_loop()
            scans.append(True)  # on the HTTP server's event loop: every stream stalls meanwhile
        except RuntimeError:
            scans.append(False)
        return real_scan(root)

    monkeypatch.setattr(index, "scan", scan)
    info = c.get("/sglang_l3/sessions").json()
    assert info["store"] == str(tmp_path) and info["sessions"] == [] and info["store_bytes"] == 0
    assert scans == [False], "GET /sglang_l3/sessions scanned the store on the event loop"
    tm.gracefully_exit = True
    assert c.post("/sglang_l3/prefetch", json={"input_ids": [1, 2, 3]}).status_code == 503
    # drop through the server: unknown -> 404, known -> upstream's close message
    # carrying DROP_MARK (what every scheduler rank's registry turns into a drop)
    from sglang_l3.patches.sessions.sessions import DROP_MARK

    closes = []

    async def close_session(obj, request=None):
        closes.append(obj)

    tm.close_session = close_session
    r = c.delete("/sglang_l3/sessions/nobody")
    assert r.status_code == 404 and "unknown session" in r.json()["error"] and not closes
    assert scans == [False, False], "DELETE /sglang_l3/sessions/ID scanned the store on the event loop"
    BOOK.remember("agent-x", [1, 2])
    r = c.delete("/sglang_l3/sessions/agent-x")
    assert r.status_code == 200 and r.json() == {"dropped": "agent-x"}
    assert [o.session_id for o in closes] == [DROP_MARK + "agent-x"]
    assert "agent-x" not in BOOK.contexts
    BOOK.hints.clear()


def test_a_timed_out_device_tokens_ask_leaves_upstreams_communicator_usable(monkeypatch):
    """GET /sglang_l3/sessions gives up on the scheduler after DEVICE_TOKENS_TIMEOUT_S.
    Upstream's internal-state communicator must come out of that as it went in: the late
    answer to our ask is not taken as the answer to the next caller's (here upstream's own
    `get_internal_state`, as /get_server_info calls it)."""
    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang_l3.patches.sessions import session_hints
    from sglang_l3.sessions.activity import DEVICE_TOKENS_KEY

    monkeypatch.setattr(session_hints, "DEVICE_TOKENS_TIMEOUT_S", 0.05)

    class _TM:
        """Upstream's own get_internal_state over upstream's communicator; the scheduler
        answers each ask later, when the test says, naming the ask it answers."""

        get_internal_state = TokenizerControlMixin.get_internal_state

        def __init__(self) -> None:
            self.asks = 0
            self.get_internal_state_communicator = FanOutCommunicator(self._send, 1)

        def auto_create_handle_loop(self) -> None:
            pass

        def _send(self, req) -> None:
            self.asks += 1

        def answer(self, n: int) -> None:
            state = {DEVICE_TOKENS_KEY: {"ask": n}}
            self.get_internal_state_communicator.handle_recv(GetInternalStateReqOutput(internal_state=state))

    async def run() -> None:
        tm = _TM()
        assert await session_hints._device_tokens(tm) is None  # the scheduler is busy: unknown
        assert tm.asks == 1
        upstream = asyncio.ensure_future(tm.get_internal_state())  # e.g. /get_server_info
        await asyncio.sleep(0.01)
        tm.answer(1)  # the late answer to our ask
        await asyncio.sleep(0.01)
        tm.answer(2)  # upstream's answer, if it has sent its ask
        states = await asyncio.wait_for(upstream, 1.0)
        assert tm.asks == 2
        assert states == [{DEVICE_TOKENS_KEY: {"ask": 2}}], "the late answer was taken as upstream's"
        # and ours works again
        later = asyncio.ensure_future(session_hints._device_tokens(tm))
        await asyncio.sleep(0.01)
        tm.answer(3)
        assert await later == {"ask": 3}

    asyncio.run(run())


def test_a_hint_dropped_as_not_restorable_says_so():
    """A hint whose context is not whole on the device, in host staging or in L3 is
    dropped by the scheduler (patch session-guard) rather than computed: its state is
    not_restorable, counted, and not a failure."""
    from sglang_l3 import metrics
    from sglang_l3.sessions.hints import NOT_RESTORABLE

    class Dropped:
        async def generate_request(self, obj, request=None):
            yield {
                "meta_info": {
                    "cached_tokens": 0,
                    "finish_reason": {"type": "abort", "message": f"sglang-l3 hint {NOT_RESTORABLE}: 9000 of ..."},
                }
            }

    async def main():
        before = metrics.get("session_hints", NOT_RESTORABLE)
        h, _ = HintBook().start(Dropped(), [1, 2], "agent-a")
        await asyncio.wait_for(h.done.wait(), 10)
        assert h.state == NOT_RESTORABLE and h.as_dict()["state"] == NOT_RESTORABLE
        assert metrics.get("session_hints", NOT_RESTORABLE) == before + 1

    asyncio.run(main())
