"""Buffer-only L3 restore of a Mamba hybrid through the real scheduler admission
path (`Scheduler._get_new_batch_prefill_raw` → `PrefillAdder.add_one_req` →
`init_load_back`), with the `reanchor` patch's checks.

After every scenario: the request is bound to the restored node N (and locked
on it), states are bit-exact, and every pool (device KV, device Mamba, request
rows, host staging) is back to its baseline once requests finish.
"""

from __future__ import annotations

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.buffer_mode.pipeline import BufferModePipeline
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector, PoolName
from sglang_l3 import metrics
from sglang_l3.patches.hicache.reanchor import ReanchorViolation, record_of
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack

# Under every simulated-device seed (test/integration/conftest.py); the second seed
# only at page size 4 (suite time).
pytestmark = pytest.mark.all_seeds(stack=(4,))

EXTRA = [90001, 90002, 90003, 90004]


@pytest.fixture(params=[1, 4, 64], ids=lambda p: f"page{p}")
def stack(request, tmp_path):
    with L3Stack(HybridSpec(page_size=request.param, kv_size=2048), str(tmp_path)) as st:
        yield st


def _seq(st: L3Stack, pages: int = 4, start: int = 1) -> list[int]:
    return list(range(start, start + max(pages * st.spec.page_size, 32)))


def _stored(st: L3Stack, seq: list[int]):
    snap = st.write(seq)
    st.evict_all()
    st.scribble()
    return snap


def _admit_restored(h: SchedulerHarness, req):
    h.arrive(req)
    h.wait_prefetch(req)
    assert h.s.tree_cache.buffer_pipeline.has_staged(req.cache_request_handle), "nothing staged"
    batch = h.admit()
    assert batch is not None and req in batch.reqs
    return batch


def assert_bound(st: L3Stack, req, seq: list[int], snap) -> None:
    """The re-anchor invariants, checked from the outside."""
    m = st.match(seq)
    node = m.last_device_node
    assert m.device_prefix_len == len(seq)
    assert req.last_node == node, f"request on node {req.last_node}, restore on {node}"
    assert req.lock is not None and req.lock.node == node
    assert req.prefix_len == len(seq) == int(st.cache.path_device_indices(node).numel())
    node_slot = st.node_mamba_slot(node)
    req_slot = int(req.kv.mamba_pool_idx)
    assert node_slot is not None and node_slot != req_slot
    assert req.kv.mamba_cow_src_index is None and not req.kv.mamba_needs_clear
    assert st.snapshot(node, req_slot).equal(snap), "request's Mamba slot / KV differ"
    assert st.snapshot(node, node_slot).equal(snap), "node's Mamba slot / KV differ"
    rec = record_of(req)
    assert rec is not None and rec.node == node and rec.committed
    assert (rec.node_slot, rec.req_slot) == (node_slot, req_slot)


def assert_baseline(st: L3Stack) -> None:
    st.flush_backups()
    st.evict_all()
    assert st.pool_sizes() == st.baseline
    assert not st.cache.buffer_pipeline.staged_prefetches
    assert not st.cache.buffer_pipeline.anchor_locks
    assert not st.cache.buffer_pipeline.ongoing_buffer_load_back


def test_basic_restore(stack: L3Stack) -> None:
    seq = _seq(stack)
    snap = _stored(stack, seq)
    h = SchedulerHarness(stack)
    before = (metrics.get("l3_restores"), metrics.get("reanchors"))
    req = h.make_req(seq + EXTRA)
    batch = _admit_restored(h, req)
    h.forward(batch)
    assert_bound(stack, req, seq, snap)
    assert (metrics.get("l3_restores"), metrics.get("reanchors")) == (before[0] + 1, before[1] + 1)
    h.finish(req)
    assert_baseline(stack)


def test_verify_mode_compares_states_at_ack(stack: L3Stack, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_L3_VERIFY", "1")
    seq = _seq(stack)
    snap = _stored(stack, seq)
    h = SchedulerHarness(stack)
    before = metrics.get("verify_checks")
    req = h.make_req(seq + EXTRA)
    h.forward(_admit_restored(h, req))
    assert metrics.get("verify_checks") == before + 1
    assert_bound(stack, req, seq, snap)
    h.finish(req)
    assert_baseline(stack)


def test_verify_right_after_the_batch_is_chosen_waits_for_the_load(tmp_path, monkeypatch) -> None:
    """Patch tp-verify-restores compares the restored states right after the scheduler
    chose the batch, before the load-back's ack: on an asynchronous device the H2D copies
    are still queued then. The check waits for them (a device-agnostic sync) instead of
    reporting bytes that have not landed as a corrupted restore."""
    from sglang_l3.patches.tp import agreement as tp_agreement

    monkeypatch.setenv("SGLANG_L3_VERIFY", "1")
    with L3Stack(HybridSpec(page_size=4), str(tmp_path)) as st:
        seq = _seq(st)
        snap = _stored(st, seq)
        h = SchedulerHarness(st)
        req = h.make_req(seq + EXTRA)
        before = metrics.get("verify_checks")
        # What Scheduler.get_next_batch_to_run (hooked by the patch) does around admission.
        batch = tp_agreement._get_next_batch_to_run(lambda sched: _admit_restored(h, req), h.s)
        assert metrics.get("verify_checks") == before + 1
        h.forward(batch)
        assert_bound(st, req, seq, snap)
        h.finish(req)
        assert_baseline(st)


def test_verify_mode_catches_a_corrupted_state(tmp_path, monkeypatch) -> None:
    """A wrong byte in the request's slot at ack time is a fail-stop, not served."""
    monkeypatch.setenv("SGLANG_L3_VERIFY", "1")
    with L3Stack(HybridSpec(page_size=4), str(tmp_path)) as st:
        seq = _seq(st)
        _stored(st, seq)
        h = SchedulerHarness(st)
        req = h.make_req(seq + EXTRA)
        h.arrive(req)
        h.wait_prefetch(req)
        h.admit()
        # Scribble the request's slot once the H2D has landed, before the ack is reaped.
        st.device_module.synchronize()
        st.mamba_cache.temporal[:, int(req.kv.mamba_pool_idx)] += 1
        with pytest.raises(ReanchorViolation, match=r"verify: restored Mamba state differs"):
            h.forward(None)


def _observe_binding(tmp_path) -> dict:
    """Restore once; record req.last_node as seen right after init_load_back returns."""
    seen: dict = {}
    installed = BufferModePipeline.init_load_back

    def observer(self, params):
        out = installed(self, params)
        if out is not None:
            seen["last_node"], seen["n"] = params.req.last_node, out[1]
        return out

    BufferModePipeline.init_load_back = observer
    try:
        with L3Stack(HybridSpec(page_size=4), str(tmp_path)) as st:
            seq = _seq(st)
            _stored(st, seq)
            h = SchedulerHarness(st)
            req = h.make_req(seq + EXTRA)
            h.forward(_admit_restored(h, req))
            h.finish(req)
    finally:
        BufferModePipeline.init_load_back = installed
    return seen


def test_bound_before_anything_observes(tmp_path) -> None:
    """Right after init_load_back returns, the request already points at N."""
    seen = _observe_binding(tmp_path)
    assert seen["last_node"] == seen["n"]


@pytest.mark.parametrize("without", ["reanchor"], indirect=True)
def test_negative_control_without_reanchor_request_keeps_old_node(tmp_path, without) -> None:
    seen = _observe_binding(tmp_path)
    assert seen["last_node"] != seen["n"], "upstream 0.5.23 rebinds only in the caller"


def test_two_requests_same_prefix_one_batch(stack: L3Stack) -> None:
    seq = _seq(stack)
    snap = _stored(stack, seq)
    h = SchedulerHarness(stack)
    a = h.make_req(seq + EXTRA, rid="A")
    b = h.make_req(seq + [x + 10 for x in EXTRA], rid="B")
    for r in (a, b):
        h.arrive(r)
    for r in (a, b):
        h.wait_prefetch(r)
    batch = h.admit()
    assert batch is not None and set(batch.reqs) == {a, b}
    h.forward(batch)
    # One restore materializes N; the other request finds it on the device.
    assert_bound(stack, a, seq, snap)
    node = stack.match(seq).last_device_node
    assert b.last_node == node and b.lock.node == node and b.prefix_len == len(seq)
    assert stack.snapshot(node, int(b.kv.mamba_pool_idx)).equal(snap), "B's CoW copy of N differs"
    h.finish(a)
    h.finish(b)
    assert_baseline(stack)


def test_full_deeper_than_mamba(stack: L3Stack) -> None:
    """J ≠ F: FULL KV still on device, its Mamba state evicted → only the state is loaded."""
    seq = _seq(stack)
    snap = stack.write(seq)
    stack.cache.evict(EvictParams(num_tokens=0, mamba_num=stack.spec.mamba_cache_size))
    m = stack.match(seq)
    assert m.device_prefix_len < len(seq), "the joint match must stop short (no Mamba on device)"
    h = SchedulerHarness(stack)
    req = h.make_req(seq + EXTRA)
    h.forward(_admit_restored(h, req))
    assert_bound(stack, req, seq, snap)
    h.finish(req)
    assert_baseline(stack)


def test_anchor_evicted_between_staging_and_admission(tmp_path, monkeypatch) -> None:
    """ "shrunk" → refetch → restored on a later pass, still bound and exact."""
    from sglang.srt.environ import envs

    with (
        envs.SGLANG_HICACHE_BUFFER_ANCHOR_LOCK_CAP.override(0.0),
        L3Stack(HybridSpec(page_size=4), str(tmp_path)) as st,
    ):
        head = _seq(st, pages=4)
        full = head + list(range(5000, 5016))
        st.write(head)
        snap = st.write(full)
        st.evict_all()
        st.write(head)  # the device anchor F = head, unpinned (cap 0)
        h = SchedulerHarness(st)
        req = h.make_req(full + EXTRA)
        h.arrive(req)
        h.wait_prefetch(req)
        assert st.cache.buffer_pipeline.has_staged(req.cache_request_handle)
        st.evict_all()  # the anchor goes before admission
        assert h.admit() is None, "the shrunk hold must be re-fetched, not admitted"
        assert req.kv.mamba_cow_src_index is None and req.kv.mamba_pool_idx is None
        st.scribble()
        batch = None
        for _ in range(50):
            h.wait_prefetch(req)
            batch = h.admit()
            if batch is not None:
                break
        assert batch is not None and req in batch.reqs
        h.forward(batch)
        assert_bound(st, req, full, snap)
        h.finish(req)
        assert_baseline(st)


def test_abort_while_staged(stack: L3Stack) -> None:
    seq = _seq(stack)
    _stored(stack, seq)
    h = SchedulerHarness(stack)
    req = h.make_req(seq + EXTRA)
    h.arrive(req)
    h.wait_prefetch(req)
    assert stack.cache.buffer_pipeline.has_staged(req.cache_request_handle)
    h.abort_queued(req)
    assert_baseline(stack)


def test_abort_after_admission(stack: L3Stack) -> None:
    seq = _seq(stack)
    snap = _stored(stack, seq)
    h = SchedulerHarness(stack)
    req = h.make_req(seq + EXTRA)
    h.forward(_admit_restored(h, req))
    assert_bound(stack, req, seq, snap)
    h.abort_running(req)
    assert_baseline(stack)


def test_restored_request_then_chunked_prefill(tmp_path) -> None:
    with L3Stack(HybridSpec(page_size=4, kv_size=2048), str(tmp_path)) as st:
        seq = _seq(st, pages=8)
        snap = _stored(st, seq)
        tail = list(range(70000, 70000 + 96))
        h = SchedulerHarness(st, chunked_prefill_size=32)
        req = h.make_req(seq + tail)
        batch = _admit_restored(h, req)
        assert h.s.chunked_req is req, "the tail must be longer than one chunk"
        h.forward(batch)
        assert_bound(st, req, seq, snap)
        chunks = 1
        while h.s.chunked_req is not None:
            h.stash_chunk()
            batch = h.admit()
            assert batch is not None and req in batch.reqs
            h.forward(batch)
            chunks += 1
        assert chunks >= 3
        assert req.extend_end == len(seq) + len(tail)
        h.finish(req)
        assert_baseline(st)


class _FailMambaGets(HiCacheStorageFailureInjector):
    """Upstream's failure injector, deterministic: every Mamba read fails
    (it runs after all KV pages were read — a read failing part-way)."""

    def _inject_failure(self, func_name: str) -> bool:
        return False

    def batch_get_v2(self, transfers, extra_info=None):
        if any(t.name == PoolName.MAMBA for t in transfers):
            return {t.name: [False] * len(t.keys or []) for t in transfers}
        return super().batch_get_v2(transfers, extra_info)


def test_storage_read_fails_part_way_recomputes(stack: L3Stack) -> None:
    seq = _seq(stack)
    _stored(stack, seq)
    cc = stack.cache.cache_controller
    real = cc.storage_backend
    cc.storage_backend = _FailMambaGets(real, 0.0, 0.0)
    try:
        h = SchedulerHarness(stack)
        req = h.make_req(seq + EXTRA)
        h.arrive(req)
        h.wait_prefetch(req)
        assert not stack.cache.buffer_pipeline.has_staged(req.cache_request_handle)
        batch = h.admit()
        assert batch is not None and req in batch.reqs
        assert req.prefix_len == 0 and record_of(req) is None, "must recompute, not restore"
        h.forward(batch)
        h.finish(req)
    finally:
        cc.storage_backend = real
    assert_baseline(stack)


def test_precheck_failure_falls_back_to_recompute(tmp_path, monkeypatch) -> None:
    """An inconsistent anchor before any copy is queued → staged hold released,
    request recomputed, counted by reason; nothing leaked."""
    installed = BufferModePipeline.prepare_staged_prefetch

    def moves_anchor(self, req):
        ok = installed(self, req)
        if ok and req.staged_prefetch_plan is not None:
            req.last_node = self._cache.root_node_handle()  # the anchor no longer matches prefix_len
        return ok

    with L3Stack(HybridSpec(page_size=4), str(tmp_path)) as st:
        seq = _seq(st)
        _stored(st, seq)
        st.write(seq[: len(seq) // 2])  # a device anchor F for the staged span
        h = SchedulerHarness(st)
        req = h.make_req(seq + EXTRA)
        h.arrive(req)
        h.wait_prefetch(req)
        before = metrics.get("recompute_fallbacks", "anchor_path_short")
        monkeypatch.setattr(BufferModePipeline, "prepare_staged_prefetch", moves_anchor)
        assert h.admit() is None
        monkeypatch.setattr(BufferModePipeline, "prepare_staged_prefetch", installed)
        assert metrics.get("recompute_fallbacks", "anchor_path_short") == before + 1
        assert not st.cache.buffer_pipeline.has_staged(req.cache_request_handle)
        assert not st.cache.buffer_pipeline.anchor_locks
        batch = h.admit()
        assert batch is not None and req in batch.reqs
        assert req.prefix_len == len(seq) // 2 and record_of(req) is None, "recomputed from F"
        h.forward(batch)
        h.finish(req)
        assert_baseline(st)


def test_violation_after_copy_is_a_fail_stop(tmp_path, monkeypatch) -> None:
    """If the loaded state were not adopted (a pending CoW would overwrite it in
    the forward), the restore stops with a message naming request and nodes."""
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    with L3Stack(HybridSpec(page_size=4), str(tmp_path)) as st:
        seq = _seq(st)
        _stored(st, seq)
        h = SchedulerHarness(st)
        req = h.make_req(seq + EXTRA, rid="victim")
        h.arrive(req)
        h.wait_prefetch(req)
        monkeypatch.setattr(MambaComponent, "_adopt_loaded_state", lambda self, r: None)
        req.kv.mamba_needs_clear = True  # what init_next_round_input leaves for a fresh slot
        orig_init = type(req).init_next_round_input

        def keep_clear(self, *a, **k):
            out = orig_init(self, *a, **k)
            self.kv.mamba_needs_clear = True
            return out

        monkeypatch.setattr(type(req), "init_next_round_input", keep_clear)
        before = metrics.get("fail_stops")
        with pytest.raises(ReanchorViolation, match=r"req=victim .*node=\d+.*pending CoW/clear"):
            h.admit()
        assert metrics.get("fail_stops") == before + 1
