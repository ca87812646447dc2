"""Patch `tool-pins` on the real cache stack (both tree cores): a context pinned
because its turn ended in a tool call is evicted last, gives way in the stated
order, and never makes a request wait.

A 1024-row device pool holds three 301-token contexts. A, B, C finish in that
order; D's prefill needs rows, so upstream's LRU evicts A first. Pinned, A
stays and B goes (control: unpinned, A goes). Two pins (A, B) under a burst
that needs the whole pool: the burst is admitted batch for batch as without
pins (no lock, admission counts pinned rows as evictable), and the pins give
way, the one expiring furthest ahead first. Negative control: with the patch's
eviction hook undone, the pinned A is evicted like any other context."""

from __future__ import annotations

from array import array

import pytest
from sglang_l3 import metrics
from sglang_l3.patches.sessions import tool_pins as tp
from sglang_l3.sessions.pin_book import EXPIRED, PIN, RETURNED
from sglang_l3.sessions.rpc import TOOL_PIN as METHOD
from sglang_l3.testing import idle_check
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack

pytestmark = pytest.mark.usefixtures("small_host_reserve")

KV_ROWS = 1024
A = list(range(1, 301))
B = list(range(1001, 1301))
C = list(range(2001, 2301))
D = list(range(3001, 3301))
FULL = 300  # a served context on the device (its sampled token has no KV yet)


@pytest.fixture(autouse=True)
def _tool_pins_on(monkeypatch):
    """The patch applies only with SGLANG_L3_TOOL_PIN set (off at the suite's start)."""
    from sglang_l3.patches import framework

    monkeypatch.setenv("SGLANG_L3_TOOL_PIN", "90")
    series = framework.load_series()
    status = framework.apply_one(next(s for s in series if s.id == "tool-pins"), series)
    assert status.state == framework.State.APPLIED, status.detail
    yield
    framework.undo("tool-pins")


def _serve(h: SchedulerHarness, ids: list[int], sid: str | None) -> None:
    req = h.make_req(ids)
    if sid is not None:
        req.session_id = sid
    h.serve(req)
    h.stack.flush_backups()


def _on_device(st: L3Stack, ids: list[int]) -> int:
    """Full-KV tokens of the context on the device; read-only (a match would touch the LRU)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return tp.device_tokens(st.cache, RadixKey(array("q", ids + [7]), None))


def _pin(st: L3Stack, sid: str, order: int) -> None:
    tp.apply_message(st.cache, {"op": PIN, "session": sid, "order": order})


def _counts() -> dict[str, float]:
    return {k: metrics.get("l3_tool_pin", k) for k in ("pinned", "hit", "expired", "gave_way", "unknown")}


def _delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in _counts().items() if v != before[k]}


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
def test_a_pinned_context_is_evicted_last(tmp_path, core, pinned):
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path), tree_core=core) as st:
        h = SchedulerHarness(st)
        for ids, sid in ((A, "agent-a"), (B, "agent-b"), (C, "agent-c")):
            _serve(h, ids, sid)
        assert _on_device(st, A) == _on_device(st, B) == FULL
        before = _counts()
        if pinned:
            _pin(st, "agent-a", 1000)
            # issue 48's audit: a pin holds no row of its own; upstream's idle check holds
            assert not idle_check.pool_leaks(st) and idle_check.check(st, "a context pinned")
        _serve(h, D, None)  # needs rows: one context goes
        if pinned:
            assert not idle_check.pool_leaks(st)
            assert _on_device(st, A) == FULL, "the pinned context was evicted"
            assert _on_device(st, B) < FULL, "the least recently used unpinned context stayed"
            tp.apply_message(st.cache, {"op": RETURNED, "session": "agent-a"})
            assert _delta(before) == {"pinned": 1, "hit": 1}
        else:
            assert _on_device(st, A) < FULL, "LRU kept the oldest context"
            assert _on_device(st, B) == FULL
        assert not tp.pins_of(st.cache)


def test_pins_never_make_a_burst_wait_and_give_way_in_order(tmp_path, core):
    """The same burst, admitted with two pins and without: the same batches; the
    pins go, B (expiring later) before A."""
    admitted: dict[bool, list[list[str]]] = {}
    for pinned in (False, True):
        with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path / str(pinned)), tree_core=core) as st:
            h = SchedulerHarness(st, max_running_requests=4)
            for ids, sid in ((A, "agent-a"), (B, "agent-b")):
                _serve(h, ids, sid)
            before = _counts()
            if pinned:
                _pin(st, "agent-a", 1000)
                _pin(st, "agent-b", 2000)  # expires later: gives way first
            burst = [
                h.make_req(list(range(10_000 + 1000 * i, 10_000 + 1000 * i + 200)), rid=f"burst{i}") for i in range(4)
            ]
            for r in burst:
                h.arrive(r)
            for r in burst:
                h.wait_prefetch(r)  # the L3 queries answered (a miss): admission is deterministic
            rounds: list[list[str]] = []
            order: list[str] = []
            while h.s.waiting_queue:
                batch = h.admit()
                rounds.append(sorted(r.rid for r in batch.reqs) if batch is not None else [])
                h.forward(batch)
                if pinned:
                    for sid, ids in (("agent-b", B), ("agent-a", A)):
                        if _on_device(st, ids) < FULL and sid not in order:
                            order.append(sid)
                for r in list(batch.reqs if batch is not None else []):
                    h.finish(r)
                h.s.running_batch.reqs = []
                assert len(rounds) < 20, rounds
            admitted[pinned] = rounds
            if pinned:
                # 4 x 201 rows after A and B (2 x 301): one of them went, B first
                assert order and order[0] == "agent-b", order
                for sid in ("agent-a", "agent-b"):
                    tp.apply_message(st.cache, {"op": EXPIRED, "session": sid})
                d = _delta(before)
                assert d.get("pinned") == 2 and d.get("gave_way", 0) >= 1, d
            st.flush_backups()
            assert st.allocator.available_size() + st.cache.full_evictable_size() == st.allocator.size
    assert admitted[True] == admitted[False], admitted


def test_the_touch_inside_eviction_is_upstreams_touch_not_a_match(tmp_path, core):
    """BEFORE `_evict` the pinned context is touched with upstream's `touch_prefix` (the
    tree walk alone): `match_prefix` (session shortcut, finalizers that may evict, linker)
    is never re-entered from inside an eviction, and the pin still holds."""
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path), tree_core=core) as st:
        h = SchedulerHarness(st)
        for ids, sid in ((A, "agent-a"), (B, "agent-b"), (C, "agent-c")):
            _serve(h, ids, sid)
        _pin(st, "agent-a", 1000)
        cache, depth, inside, touched = st.cache, [0], [], []
        evict, match, touch = cache._evict, cache.match_prefix, cache.touch_prefix

        def evict_spy(*a, **k):
            depth[0] += 1
            try:
                return evict(*a, **k)
            finally:
                depth[0] -= 1

        def match_spy(*a, **k):
            inside.append(depth[0])
            return match(*a, **k)

        def touch_spy(key):
            touched.append(depth[0])
            return touch(key)

        cache._evict, cache.match_prefix, cache.touch_prefix = evict_spy, match_spy, touch_spy
        try:
            _serve(h, D, None)  # needs rows: an eviction, with a pin to place
        finally:
            del cache._evict, cache.match_prefix, cache.touch_prefix
        assert touched and all(d > 0 for d in touched), "the pin was not touched inside the eviction"
        assert [d for d in inside if d > 0] == [], "match_prefix re-entered from inside _evict"
        assert _on_device(st, A) == FULL, "the pinned context was evicted"
        tp.apply_message(st.cache, {"op": RETURNED, "session": "agent-a"})


def test_a_pin_of_an_unknown_session_pins_nothing(tmp_path):
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path)) as st:
        before = _counts()
        _pin(st, "never-seen", 5)
        tp.apply_message(st.cache, {"op": RETURNED, "session": "never-seen"})
        tp.apply_message(st.cache, {"op": "bogus", "session": "x"})
        assert _delta(before) == {"unknown": 1}
        assert not tp.pins_of(st.cache)


def test_pin_messages_are_taken_out_before_upstream_sees_them(tmp_path):
    """The scheduler hook applies pin messages and passes everything else on, in order."""
    from sglang.srt.managers.io_struct import RpcReqInput

    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path)) as st:
        _serve(SchedulerHarness(st), A, "agent-a")
        other = RpcReqInput(method="something_else", parameters={})
        pin = RpcReqInput(method=METHOD, parameters={"op": PIN, "session": "agent-a", "order": 1})
        assert tp.take_pin_messages(st.cache, [pin, other]) == [other]
        assert list(tp.pins_of(st.cache)) == ["agent-a"]


def test_negative_control_without_the_eviction_hook_the_pin_does_nothing(tmp_path):
    from sglang_l3.patches import framework

    framework.undo("tool-pins")
    if True:
        with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path)) as st:
            h = SchedulerHarness(st)
            for ids, sid in ((A, "agent-a"), (B, "agent-b"), (C, "agent-c")):
                _serve(h, ids, sid)
            _pin(st, "agent-a", 1000)
            _serve(h, D, None)
            assert _on_device(st, A) < FULL
