"""Shared by the streamed-restore tests (no tests here)."""

from __future__ import annotations

from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.testing.stack import L3Stack


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
