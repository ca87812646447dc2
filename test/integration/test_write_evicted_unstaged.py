"""A queued L3 write whose node the device evicts before it stages is counted
(`streamed-write`, `l3_write_dropped{evicted}`).

Upstream pins a buffer-mode node only from its D2H launch; an intent still queued
when its node leaves the device is swept at the next flush (`_split_pieces` finds
nothing left), and the context is not in L3. Under load, with a host buffer of a
page, that is the likely cause of one of 32 returning agents recomputing in
test/e2e/test_many_agents_server.py in CI (inferred; that run's log is gone).
The sweep is upstream's; this checks that it is counted
and that nothing of the node reached the store (a fresh reader restores 0), while
the same write flushed before the eviction restores whole (the control).

Real upstream stack on CPU (`L3Stack`), both tree cores, page 64.
"""

from __future__ import annotations

import pytest
from sglang_l3 import metrics
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack

PAGE = 64
SPEC = HybridSpec(page_size=PAGE, kv_size=2048, max_context_len=2048)
SEQ = list(range(5, 5 + 5 * PAGE))


def _write_then_evict(tmp_path, core: str, *, flush_first: bool) -> float:
    """Write SEQ (queued), evict the device, then flush; returns the evicted count."""
    with L3Stack(SPEC, str(tmp_path), tree_core=core) as w:
        pipe = w.cache.buffer_pipeline
        before = metrics.get("l3_write_dropped", "evicted")
        w.write(SEQ, marker=2.0, flush=flush_first)
        if not flush_first:
            assert pipe.pending_write_queue, "the write must still be queued (not staged)"
        w.evict_all()
        assert w.match(SEQ).device_prefix_len == 0, "the node must have left the device"
        w.settle(timeout=120)
        assert not pipe.pending_write_queue and not pipe.inflight_backup_pools
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
def test_a_write_swept_with_its_evicted_node_is_counted(tmp_path, core: str) -> None:
    swept = _write_then_evict(tmp_path, core, flush_first=False)
    assert swept >= 1, "the swept write was not counted"
    assert _restorable(tmp_path, core) == 0, "nothing of the swept node may be in the store"


def test_a_write_staged_before_the_eviction_is_kept_and_not_counted(tmp_path) -> None:
    swept = _write_then_evict(tmp_path, "rust", flush_first=True)
    assert swept == 0
    assert _restorable(tmp_path, "rust") == len(SEQ)
