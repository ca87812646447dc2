"""Stale Mamba copy-on-write source on the admission `continue` paths (patch stale-cow).

Recipe (upstream-0.5.23 notes §3, "Known holes"), through the real scheduler
admission code: the tree holds A = T[:16] (slot Sa) and B = T[:32] (slot Sb);
request R = T[:48] arrives with a storage prefetch (L3 holds no Mamba state:
write_through_selective). B is evicted; an admission pass runs
init_next_round_input (R gets private slot P with CoW source Sa) and takes the
`continue` after _prefetch_after_device_hit_loss. A's state is evicted, another
request takes Sa and writes 7.0 into it. The next pass matches at the root and
admits R without a staged load; the deferred CoW/clear step must leave R's
state at zero, not another request's 7.0.
"""

from __future__ import annotations

import pytest
import torch
from sglang_l3 import metrics
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack


def _take_slot(st: L3Stack, wanted: int) -> list:
    """Another request takes slot `wanted`: drain the free list, keep `wanted`,
    give the rest back."""
    alloc = st.req_to_token_pool.mamba_allocator
    drained = []
    while (slot := alloc.alloc(1)) is not None:
        drained.append(slot)
    keep = [t for t in drained if int(t.reshape(-1)[0]) == wanted]
    for t in drained:
        if int(t.reshape(-1)[0]) != wanted:
            alloc.free(t)
    assert keep, (
        f"slot {wanted} is not free after eviction (drained {len(drained)}, "
        f"mamba protected={st.cache.tree_core.mamba_protected_size()} "
        f"evictable={st.cache.tree_core.mamba_evictable_size()})"
    )
    return keep


def run_recipe(page_size: int, tree_core: str, tmp_path) -> torch.Tensor:
    with L3Stack(
        HybridSpec(page_size=page_size),
        str(tmp_path),
        tree_core=tree_core,
        write_policy="write_through_selective",
        # One L3 re-query after the device prefix shrank; the next pass admits as is.
        server_args={"hicache_storage_prefetch_retry_max_attempts": 1},
    ) as st:
        T = list(range(1, 49))
        st.write(T[:16], state=1.0, flush=False)
        st.write(T[:32], state=2.0, flush=False)
        sa = st.node_mamba_slot(st.match(T[:16]).last_device_node)
        assert sa is not None
        h = SchedulerHarness(st)
        r = h.make_req(T, rid="R")
        h.arrive(r)
        h.wait_prefetch(r)
        assert r.storage_prefetch_last_match_len == 32
        # Evict B only (the LRU leaf).
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        st.cache.evict(EvictParams(num_tokens=16, mamba_num=1))
        assert st.match(T).device_prefix_len == 16, "B should be gone, A kept"
        assert h.admit() is None, "R must take the device-hit-loss `continue`"
        # A's state goes; another request takes Sa and writes 7.0 into it.
        # The re-issued lookup pins A as its anchor until it completes (a miss).
        h.wait_prefetch(r)
        # A's host backup (write_through_selective) must be acked before A can go: under
        # lagging acks it is still in flight here, and A's slot stays protected till then.
        st.drain_host_writes()
        st.evict_all()
        taken = _take_slot(st, sa)
        st.mamba_cache.temporal[:, sa] = 7.0
        for c in st.mamba_cache.conv:
            c[:, sa] = 7.0
        h.wait_prefetch(r)
        batch = h.admit()
        assert batch is not None and r in batch.reqs
        assert r.prefix_len == 0
        h.forward(batch)
        state = h.mamba_state(int(r.kv.mamba_pool_idx))
        for t in taken:
            st.req_to_token_pool.mamba_allocator.free(t)
        return state


@pytest.mark.all_seeds(page_size=(4,), tree_core=("rust",))
@pytest.mark.parametrize("tree_core", ["rust", "python"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_no_stale_cow_after_device_hit_loss(tmp_path, page_size: int, tree_core: str) -> None:
    before = metrics.get("stale_cow_cleanups", "device_hit_loss")
    state = run_recipe(page_size, tree_core, tmp_path)
    assert all(torch.count_nonzero(t) == 0 for t in state), "R starts from another request's state"
    assert metrics.get("stale_cow_cleanups", "device_hit_loss") == before + 1


@pytest.mark.parametrize("without", ["stale-cow"], indirect=True)
def test_negative_control_without_patch_reads_foreign_state(tmp_path, without) -> None:
    state = run_recipe(4, "rust", tmp_path)
    assert torch.all(state[0] == 7.0), "without the patch the stale CoW copies the foreign state"
