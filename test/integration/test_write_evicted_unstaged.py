"""A node whose L3 write is still queued stays on the device until the write staged
(patch `write-guard`); without the guard the write is swept with its evicted node and
counted (`streamed-write`, `l3_write_dropped{evicted}`).

Upstream pins a buffer-mode node only from its D2H launch; an intent still queued
when its node leaves the device is swept at the next flush (`_split_pieces` finds
nothing left), and the context is not in L3. Under load, with a host buffer of a
page, that was the likely cause of one of 32 returning agents recomputing in
test/e2e/test_many_agents_server.py in CI (inferred; that run's log is gone).
With the guard, an eviction while the write is queued leaves the node, the write
stages at the next flush and a fresh reader restores all of it; with the guard
undone (the negative control), nothing of the node reaches the store and the sweep
is counted. The same write flushed before the eviction restores whole either way.

Real upstream stack on CPU (`L3Stack`), both tree cores, page 64.
"""

from __future__ import annotations

import pytest
from sglang_l3 import metrics
from sglang_l3.patches.hicache import write_guard
from sglang_l3.testing import idle_check
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack

PAGE = 64
SPEC = HybridSpec(page_size=PAGE, kv_size=2048, max_context_len=2048)
SEQ = list(range(5, 5 + 5 * PAGE))


def _write_then_evict(tmp_path, core: str, *, flush_first: bool, guarded: bool = True) -> float:
    """Write SEQ (queued), evict the device, then flush; returns the evicted count."""
    with L3Stack(SPEC, str(tmp_path), tree_core=core) as w:
        pipe = w.cache.buffer_pipeline
        before = metrics.get("l3_write_dropped", "evicted")
        w.write(SEQ, marker=2.0, flush=flush_first)
        if not flush_first:
            assert pipe.pending_write_queue, "the write must still be queued (not staged)"
            assert bool(write_guard.guarded_nodes(pipe)) == guarded
            # issue 48's audit: guarded rows are upstream tree locks (counted as protected)
            assert not idle_check.pool_leaks(w)
        w.evict_all(stage_queued_writes=False)
        assert not idle_check.pool_leaks(w)
        kept = w.match(SEQ).device_prefix_len
        if flush_first or not guarded:
            assert kept == 0, "the node must have left the device"
        else:
            assert kept == len(SEQ), "a node whose write is queued must stay on the device"
        w.settle(timeout=120)
        assert idle_check.check(w, "the write settled"), "the pipeline must be idle once the write is done"
        assert not pipe.pending_write_queue and not pipe.inflight_backup_pools
        assert not write_guard.guarded_nodes(pipe)
        w.evict_all()
        assert w.match(SEQ).device_prefix_len == 0
        assert w.pool_sizes() == w.baseline
        return metrics.get("l3_write_dropped", "evicted") - before


def _restorable(tmp_path, core: str) -> int:
    with L3Stack(SPEC, str(tmp_path), tree_core=core, server_args={"hicache_ratio": 1.0}) as r:
        h, loaded = r.prefetch(SEQ, "probe")
        if r.cache.buffer_pipeline.has_staged(h):
            r.cache.buffer_pipeline.release_staged_hold(h)
        r.settle()
        assert r.pool_sizes() == r.baseline
        return loaded


@pytest.mark.parametrize("core", TREE_CORES)
def test_a_queued_write_keeps_its_node_until_it_staged(tmp_path, core: str) -> None:
    assert _write_then_evict(tmp_path, core, flush_first=False) == 0
    assert _restorable(tmp_path, core) == len(SEQ), "the guarded write must reach the store whole"


@pytest.mark.parametrize("without", ["write-guard"], indirect=True)
@pytest.mark.parametrize("core", TREE_CORES)
def test_negative_control_without_guard_the_write_is_swept_and_counted(tmp_path, core: str, without) -> None:
    swept = _write_then_evict(tmp_path, core, flush_first=False, guarded=False)
    assert swept >= 1, "the swept write was not counted"
    assert _restorable(tmp_path, core) == 0, "nothing of the swept node may be in the store"


def test_a_write_staged_before_the_eviction_is_kept_and_not_counted(tmp_path) -> None:
    swept = _write_then_evict(tmp_path, "rust", flush_first=True)
    assert swept == 0
    assert _restorable(tmp_path, "rust") == len(SEQ)


def _staged_restore_and_guarded_write(tmp_path, r: L3Stack) -> tuple:
    """A staged restore holding the host staging a queued, guarded write of SEQ needs."""
    pipe = r.cache.buffer_pipeline
    cc = r.cache.cache_controller
    cc.prefetch_capacity_limit = cc.mem_pool_host.size
    h, loaded = r.prefetch(A_STAGED, "staged")
    assert loaded == len(A_STAGED) and pipe.has_staged(h), "the restore must be staged, holding host staging"
    r.write(SEQ, marker=2.0, flush=False)
    assert write_guard.guarded_nodes(pipe)
    return pipe, h


A_STAGED = list(range(9000, 9000 + 8 * PAGE))


def _write_staged_context(tmp_path) -> None:
    with L3Stack(SPEC, str(tmp_path), tree_core="rust") as w:
        w.write(A_STAGED, marker=1.0)
        w.settle(timeout=120)


def _refused_for_rows(r: L3Stack, pipe, h) -> None:
    """Upstream's admission defers the staged restore for device capacity (as
    PrefillAdder does when init_load_back cannot take rows)."""
    req = r.new_req("staged", A_STAGED)
    req.cache_request_handle = h
    pipe.defer_staged_admission(req, "full")


# upstream's staged path (a restore holding host staging until admission): a hit that fits
# the host is streamed by patch stream-fitting-hits when the device takes it whole, and keeps
# this path when it cannot (a busy device), under best_effort, or within one piece
@pytest.mark.parametrize("without", ["stream-fitting-hits"], indirect=True)
def test_the_guard_holds_while_a_staged_restore_only_waits_its_turn(tmp_path, without) -> None:
    """Issue 49: a staged restore that waits for admission without being refused rows
    (behind --max-running-requests 1, a running prefill) never opens the valve, however
    many flushes pass (upstream flushes on every tick): the queued write keeps its node
    and reaches L3 once the restore is admitted or gone. Without the deferral condition
    the valve opened after 8 flushes and the write was swept."""
    _write_staged_context(tmp_path)
    with L3Stack(SPEC, str(tmp_path), tree_core="rust", server_args={"hicache_ratio": 0.25}) as r:
        pipe, h = _staged_restore_and_guarded_write(tmp_path, r)
        c0 = metrics.snapshot()
        for _ in range(10 * write_guard.VALVE_FLUSHES):
            pipe.flush_pending_writes()
        assert pipe.pending_write_queue, "the write must wait for host staging"
        assert write_guard.guarded_nodes(pipe), "the valve opened for a restore that only waits its turn"
        assert metrics.get("l3_write_guard", "released") == c0.get("l3_write_guard{released}", 0)
        r.evict_all(stage_queued_writes=False)
        assert r.match(SEQ).device_prefix_len == len(SEQ)
        pipe.release_staged_hold(h)  # admitted or gone: host staging frees
        r.settle(timeout=120)
        assert metrics.get("l3_write_dropped", "evicted") == c0.get("l3_write_dropped{evicted}", 0)
        r.evict_all()
        assert r.pool_sizes() == r.baseline
    assert _restorable(tmp_path, "rust") == len(SEQ), "the guarded write must reach the store whole"


# upstream's staged path (a restore holding host staging until admission): a hit that fits
# the host is streamed by patch stream-fitting-hits when the device takes it whole, and keeps
# this path when it cannot (a busy device), under best_effort, or within one piece
@pytest.mark.parametrize("without", ["stream-fitting-hits"], indirect=True)
def test_the_guard_gives_way_to_a_staged_restore_that_holds_host_staging(tmp_path, without) -> None:
    """The valve: a staged restore holds the host staging a guarded write needs, and at
    admission it is refused for device capacity (it may need the guarded rows). After
    `VALVE_FLUSHES` flushes without progress the guards are released (counted), the
    node may be evicted, and its write is swept and counted as without the guard;
    nothing leaks."""
    _write_staged_context(tmp_path)
    with L3Stack(SPEC, str(tmp_path), tree_core="rust", server_args={"hicache_ratio": 0.25}) as r:
        pipe, h = _staged_restore_and_guarded_write(tmp_path, r)
        c0 = metrics.snapshot()
        pipe.flush_pending_writes()  # the head stops
        _refused_for_rows(r, pipe, h)
        for _ in range(write_guard.VALVE_FLUSHES - 2):
            pipe.flush_pending_writes()
        assert pipe.pending_write_queue, "the write must wait for host staging"
        assert write_guard.guarded_nodes(pipe), "the guard must hold before the valve opens"
        r.evict_all(stage_queued_writes=False)
        assert r.match(SEQ).device_prefix_len == len(SEQ)
        pipe.flush_pending_writes()
        assert not write_guard.guarded_nodes(pipe), "the valve must release the guards"
        assert metrics.get("l3_write_guard", "released") == c0.get("l3_write_guard{released}", 0) + 1
        r.evict_all(stage_queued_writes=False)
        assert r.match(SEQ).device_prefix_len == 0
        pipe.flush_pending_writes()
        assert metrics.get("l3_write_dropped", "evicted") > c0.get("l3_write_dropped{evicted}", 0)
        assert not pipe.pending_write_queue
        pipe.release_staged_hold(h)
        r.settle(timeout=120)
        r.evict_all()
        assert r.pool_sizes() == r.baseline
