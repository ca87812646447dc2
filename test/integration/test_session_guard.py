"""Patch `session-guard` on the real cache stack (both tree cores): two open
sessions, a 512-row device pool that holds about one context. A speaks, B
speaks (A leaves the device), then "A speaks next". The hint may replace B's
device context only while B is idle (nothing of B queued or running, no hint
of B's own pending, B not of higher priority): then it lands and B's context
stays restorable from L3, bit-exact. Otherwise it is declined before it is
queued (deferred_device_full, B named; no L3 read, no allocation, no
eviction). Negative control: SGLANG_L3_DISABLE=session-guard makes the
protection cases fail (the hint evicts B)."""

from __future__ import annotations

import time

import pytest
from sglang_l3.patches.sessions.sessions import registry_of
from sglang_l3.sessions.hints import DEFERRED_DEVICE_FULL, hint_rid
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack

# Under every simulated-device seed (test/integration/conftest.py); the second seed
# only on the Rust tree core (suite time).
pytestmark = [pytest.mark.all_seeds(core=("rust",)), pytest.mark.usefixtures("small_host_reserve")]

A = list(range(1, 277))  # 276 tokens + 1 output token: 277 of the 512-row device pool
B = list(range(2000, 2300))  # 300 tokens + 1: fits only by evicting most of A
KV_ROWS = 512
CASES = ["busy", "hinted", "priority", "plain_hint"]


def _serve(h: SchedulerHarness, ids: list[int], sid: str):
    req = h.make_req(ids)
    req.session_id = sid
    h.serve(req)
    h.stack.flush_backups()
    return req


def _setup(st: L3Stack) -> tuple[SchedulerHarness, list]:
    """A speaks, B speaks (A leaves the device). Returns (harness, declined hints)."""
    h = SchedulerHarness(st)
    sent: list = []
    h.s.send_abort_output = lambda abort, req: sent.append((abort, req))
    _serve(h, A, "agent-a")
    _serve(h, B, "agent-b")
    return h, sent


def _hint_a(h: SchedulerHarness, *, plain: bool = False):
    return h.make_req(A + [7], rid=hint_rid(None if plain else "agent-a"), max_new_tokens=0)


def _reads(st: L3Stack) -> int:
    return st.cache.cache_controller.storage_backend.store.counters.get("read_hits")


def _protect_b(h: SchedulerHarness, case: str) -> object:
    """Put B in a protected state; returns what undoes it (or None)."""
    if case == "busy":  # a turn of B is queued
        turn = h.make_req(B + [7] + list(range(3000, 3010)))
        turn.session_id = "agent-b"
        h.arrive(turn)
        return turn
    if case == "hinted":  # "B speaks next" landed, B's request not here yet
        h.serve(h.make_req(B + [7], rid=hint_rid("agent-b"), max_new_tokens=0))
        return None
    if case == "priority":
        assert registry_of(h.stack.cache).set_priority("agent-b", 5)
    return None  # plain_hint: an input_ids hint has the lowest priority


@pytest.mark.parametrize("case", CASES)
def test_a_hint_never_evicts_a_protected_open_session(tmp_path, core, case):
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path), tree_core=core) as st:
        h, sent = _setup(st)
        ctx_b = B + [7]
        turn = _protect_b(h, case)
        resident = st.match(ctx_b).device_prefix_len
        assert resident >= 256, resident
        free, reads = st.allocator.available_size(), _reads(st)

        hint = _hint_a(h, plain=case == "plain_hint")
        h.arrive(hint)
        assert hint not in h.s.waiting_queue
        assert len(sent) == 1 and sent[0][1] is hint, "the hint was not declined"
        message = sent[0][0].finished_reason["message"]
        assert DEFERRED_DEVICE_FULL in message and "agent-b" in message, message
        assert "agent-a (" not in message, "the hinted session protects nothing against itself"
        assert st.match(ctx_b).device_prefix_len == resident, "B's device context was touched"
        assert st.allocator.available_size() == free
        assert _reads(st) == reads, "a declined hint read L3"
        if turn is not None:
            h.abort_queued(turn)


def test_a_hint_replaces_an_idle_open_sessions_context_which_stays_restorable(tmp_path, core):
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path), tree_core=core) as st:
        h, sent = _setup(st)
        ctx_b = B + [7]
        m = st.match(ctx_b)
        resident = m.device_prefix_len
        assert resident >= 256, resident
        want = st.snapshot(m.last_device_node, st.node_mamba_slot(m.last_device_node))
        reads = _reads(st)

        h.serve(_hint_a(h))  # B is idle: "A speaks next" lands
        st.flush_backups()
        assert not sent
        assert _reads(st) > reads, "the hint did not read A from L3"
        assert st.match(A + [7]).device_prefix_len >= 256
        assert st.match(ctx_b).device_prefix_len < resident, "B was not replaced"

        # B's context is safe in L3: restored bit-exact
        req, loaded = st.restore(ctx_b[:resident], "restore-b")
        st.check_restored(ctx_b[:resident], req, loaded, want)
        st.release(req)


def test_the_hinted_sessions_own_request_consumes_its_claim(tmp_path):
    """B's hint landed (B protected); B's request arrives and finishes: B is
    idle again and A's hint lands."""
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path)) as st:
        h, sent = _setup(st)
        _protect_b(h, "hinted")
        _serve(h, B + [7], "agent-b")
        h.serve(_hint_a(h))
        assert not sent
        assert st.match(A + [7]).device_prefix_len >= 256


def test_a_context_still_queued_for_l3_is_protected(tmp_path, core):
    """B finished but its pages' buffer-mode writes are still queued (not yet
    launched: an eviction would drop them): A's hint is declined; once the
    writes are out, it lands."""
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path), tree_core=core) as st:
        h = SchedulerHarness(st)
        sent: list = []
        h.s.send_abort_output = lambda abort, req: sent.append((abort, req))
        _serve(h, A, "agent-a")
        b = h.make_req(B)
        b.session_id = "agent-b"
        h.serve(b)  # no flush: B's writes stay queued
        assert st.cache.buffer_pipeline.pending_write_queue, "nothing queued for L3"
        resident = st.match(B + [7]).device_prefix_len
        h.arrive(_hint_a(h))
        assert len(sent) == 1, "the hint was not declined"
        message = sent[0][0].finished_reason["message"]
        assert "agent-b (writing)" in message, message
        assert st.match(B + [7]).device_prefix_len == resident
        st.flush_backups()
        h.serve(_hint_a(h))
        assert len(sent) == 1
        assert st.match(A + [7]).device_prefix_len >= 256


def test_a_hint_whose_context_is_not_in_l3_is_dropped_not_computed(tmp_path, core, monkeypatch):
    """A hint stages only what the device, host staging and L3 hold (plus a short tail):
    a hint of A extended by tokens no tier holds would be a prefill of them, so it is
    dropped at admission (not_restorable), computing nothing and holding nothing; the
    same hint of A alone lands."""
    from sglang_l3.patches.sessions import session_guard

    monkeypatch.setattr(session_guard, "HINT_MAX_COMPUTE_TOKENS", 16)
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path), tree_core=core) as st:
        h, sent = _setup(st)  # A is in L3, B on the device
        fresh = list(range(5000, 5040))  # 40 tokens no tier holds
        hint = h.make_req(A + [7] + fresh, rid=hint_rid("agent-a"), max_new_tokens=0)
        h.arrive(hint)
        h.wait_prefetch(hint)
        batch = h.admit()
        assert batch is None or all(r is not hint for r in batch.reqs), "the hint was admitted: a prefill"
        assert not any(r is hint for r in h.s.waiting_queue), "the hint stays queued"
        assert len(sent) == 1 and sent[0][1] is hint, "the hint was not answered"
        assert "not_restorable" in sent[0][0].finished_reason["message"]
        assert st.match(A + [7] + fresh).device_prefix_len < len(A), "it computed (or restored) anyway"
        from sglang_l3.testing import idle_check

        # A's hit fits host staging and was streamed (patch stream-fitting-hits): its rows go
        # back once its piece copies completed, at a tick (on the simulated device, later);
        # until then the pipeline is not idle, so upstream's idle check does not run
        deadline = time.monotonic() + 60
        while not st.cache.buffer_pipeline.is_idle() and time.monotonic() < deadline:
            st.cache.check_hicache_events()
            time.sleep(0.002)
        assert not idle_check.pool_leaks(st), "the dropped hint holds rows or slots"

        h.serve(_hint_a(h))  # A alone is restorable: it lands
        assert len(sent) == 1
        assert st.match(A + [7]).device_prefix_len >= 256


def test_a_hint_restored_through_a_streamed_restore_is_not_dropped(tmp_path, core, monkeypatch):
    """A context larger than host staging comes back in pieces (patch streamed-restore):
    its hint covers the whole context from L3, so it is admitted, never counted as compute."""
    from sglang_l3.patches.sessions import session_guard

    monkeypatch.setattr(session_guard, "HINT_MAX_COMPUTE_TOKENS", 64)
    spec = HybridSpec(page_size=64, kv_size=4096, max_context_len=4096)
    args = {"hicache_ratio": 0.25}
    seq = list(range(5, 5 + 1792))
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args=args) as w:
        w.write(seq, marker=4.0)
        w.settle()
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args=args) as st:
        cc = st.cache.cache_controller
        cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)
        assert len(seq) > cc.mem_pool_host.size  # streamed
        h = SchedulerHarness(st, chunked_prefill_size=4096)
        sent: list = []
        h.s.send_abort_output = lambda abort, req: sent.append((abort, req))
        hint = h.make_req(seq + [3], rid=hint_rid(None), max_new_tokens=0)
        h.arrive(hint)
        h.wait_prefetch(hint)
        batch = h.admit()
        assert not sent, sent[0][0].finished_reason if sent else None
        assert batch is not None and hint in batch.reqs
        assert hint.prefix_len == len(seq)
        h.forward(batch)
        h.finish(hint)
        st.settle()
