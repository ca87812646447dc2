"""Shared by the streamed-restore tests (no tests here)."""

from __future__ import annotations

import time

from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.testing.stack import HybridSpec, L3Stack

BUFFER = 256  # target host KV pool (tokens); the pool rounds it up to pages


def make_spec(page_size: int, context: int) -> HybridSpec:
    kv = max(4096, (2 * context + 1024 + 1023) // 1024 * 1024)
    return HybridSpec(page_size=page_size, kv_size=kv, max_context_len=context + 256)


def small(spec: HybridSpec) -> dict:
    return {"hicache_ratio": BUFFER / spec.kv_size}


def reader(spec: HybridSpec, tmp_path, core: str) -> L3Stack:
    st = L3Stack(spec, str(tmp_path), tree_core=core, server_args=small(spec))
    cc = st.cache.cache_controller
    # L3Stack raises the load limit to the whole pool; keep upstream's 90% here.
    cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)
    return st


def write(spec: HybridSpec, tmp_path, core: str, seqs: list[list[int]]) -> list:
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args=small(spec)) as w:
        snaps = [w.write(seq, marker=3.0 + i) for i, seq in enumerate(seqs)]
        w.settle()
        assert not w.cache.buffer_pipeline.inflight_backup_pools
    return snaps


def pump(st: L3Stack, cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        st.cache.check_hicache_events()
        time.sleep(0.002)


def context(st_spec: HybridSpec, times: int, start: int = 11) -> list[int]:
    # The host pool comes out one page above BUFFER (257 tokens at page 1, 320 at 64).
    n = times * (BUFFER + st_spec.page_size)
    return list(range(start, start + n))


def back_to_baseline(st: L3Stack, *reqs) -> None:
    """Release `reqs`, evict, settle: no stream, anchor lock, prefetch occupancy or
    pool capacity is left behind, and the tree is consistent."""
    for req in reqs:
        st.release(req)
    st.evict_all()
    st.settle()
    pipe = st.cache.buffer_pipeline
    assert not lane_of(pipe).streams
    assert pipe.anchor_locked_tokens_ == 0
    assert pipe.is_idle()
    assert st.cache.cache_controller.prefetch_tokens_occupied == 0
    st.cache.sanity_check()
    assert st.pool_sizes() == st.baseline, "a pool did not return to its baseline"
