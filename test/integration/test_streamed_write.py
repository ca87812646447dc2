"""Streamed L3 write-through (`streamed-write`, issue 11): a context several
times larger than the host staging buffer reaches L3 whole, window by window.

Writer: a small host buffer (`hicache_ratio`); reader: a fresh `L3Stack` over
the same directory (a restart) with a buffer larger than the context, so only
the write path is under test. Real upstream stack on CPU, both tree cores,
page sizes 1 and 64; KV and both Mamba slots bit-exact; pools back to baseline.
Negative control: with the patch undone the writer stages nothing of the KV
(today's oversize drop) and the reader restores 0 tokens.
"""

from __future__ import annotations

import pytest
from sglang_l3 import metrics
from sglang_l3.testing import idle_check
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack

KV_SIZE = 4096


def spec(page_size: int, context: int) -> HybridSpec:
    return HybridSpec(page_size=page_size, kv_size=KV_SIZE, max_context_len=max(2048, context + 128))


def small_buffer_args(page_size: int) -> dict:
    # Host KV pool of ~256-320 tokens next to a 4096-token device pool.
    return {"hicache_ratio": 0.0625}


def big_buffer_args(context: int) -> dict:
    return {"hicache_ratio": 2.0 * (context + 256) / KV_SIZE}


def write_small(tmp_path, page_size: int, core: str, times: int) -> tuple[list[int], object, int]:
    """Write one context `times` x the writer's host buffer; return (seq, snapshot, buffer)."""
    with L3Stack(
        spec(page_size, 0),
        str(tmp_path),
        tree_core=core,
        server_args=small_buffer_args(page_size),
    ) as w:
        buf = w.cache.cache_controller.mem_pool_host.size
        n = times * buf // page_size * page_size
        seq = list(range(7, 7 + n))
        before = metrics.get("l3_stream_write_windows")
        want = w.write(seq, marker=3.0)
        for _ in range(20):  # issue 48's audit: windows in flight hold only rows upstream's check sees
            w.cache.check_hicache_events()
            assert not idle_check.pool_leaks(w)
        w.settle()
        assert idle_check.check(w, "the write settled")
        pipe = w.cache.buffer_pipeline
        windows = metrics.get("l3_stream_write_windows") - before
        assert not pipe.inflight_backup_pools and not pipe.pending_write_queue and not pipe.ongoing_backup
        w.evict_all()
        assert w.pool_sizes() == w.baseline, "a writer pool is not back at its baseline"
    return seq, want, windows


def restore_big(tmp_path, page_size: int, core: str, seq: list[int], want) -> int:
    with L3Stack(
        spec(page_size, len(seq)),
        str(tmp_path),
        tree_core=core,
        server_args=big_buffer_args(len(seq)),
    ) as r:
        assert r.cache.cache_controller.mem_pool_host.size > len(seq)
        r.scribble()
        h, _staged = r.prefetch(seq, "probe")
        if not r.cache.buffer_pipeline.has_staged(h):
            return 0
        r.cache.buffer_pipeline.release_staged_hold(h)
        # the probe's device rows are freed once its copies completed (a later tick):
        # admitting before that finds the pool short (device_capacity), as a busy box showed
        r.settle()
        req, loaded = r.restore(seq, "reader")
        m = r.match(seq)
        assert m.device_prefix_len == len(seq) == loaded
        assert req.last_node == m.last_device_node
        slot = int(req.kv.mamba_pool_idx)
        assert r.snapshot(m.last_device_node, slot).equal(want), "request slot differs"
        assert r.snapshot(m.last_device_node, r.node_mamba_slot(m.last_device_node)).equal(want)
        k, v = r.expected_kv(seq)
        snap = r.snapshot(m.last_device_node, None)
        assert snap.k.equal(k) and snap.v.equal(v)
        r.release(req)
        r.evict_all()
        r.settle()
        assert r.pool_sizes() == r.baseline
        return loaded


@pytest.mark.all_seeds(core=("rust",), page_size=(64,))
@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("page_size", (1, 64))
def test_context_8x_buffer_fully_written(tmp_path, page_size: int, core: str) -> None:
    dropped = metrics.get("l3_write_dropped", "aux_oversize")
    seq, want, windows = write_small(tmp_path, page_size, core, times=8)
    assert windows >= 8, f"expected a streamed write, got {windows} windows"
    assert metrics.get("l3_write_dropped", "aux_oversize") == dropped
    assert restore_big(tmp_path, page_size, core, seq, want) == len(seq)


@pytest.mark.parametrize("without", ["streamed-write"], indirect=True)
def test_without_patch_8x_context_is_not_written(tmp_path, without) -> None:
    seq, want, windows = write_small(tmp_path, 64, "rust", times=8)
    assert windows == 0
    assert restore_big(tmp_path, 64, "rust", seq, want) == 0
