"""Streamed restore when the device pool cannot take the whole storage hit now
(`streamed-restore`, issue 11; issue 30's quarter-buffer Hermes run).

Real upstream stack on CPU (`L3Stack`) and the real admission path (`SchedulerHarness`:
`_add_request_to_queue` → `_prefetch_kvcache` → `_get_new_batch_prefill_raw`,
`PrefillAdder.add_one_req`), page sizes 1 and 64, both tree cores. A conversation is
written in two turns (checkpoints at the end of turn 1 and of turn 2); a fresh reader's
device pool is mostly held by another request.

- `wait`: the pool could hold the whole hit, so it waits, parked and holding nothing
  (`waited_busy`; nothing cut, nothing restored yet), until the other request's rows
  go; then the whole context is restored: KV and the request's Mamba slot bit-exact
  at turn 2. (The request could not be admitted earlier: admission needs its whole
  remaining prompt on the device.)
- `cut`, the fallback for a hit the whole pool could not hold (here: the wait turned
  off): the longest part ending at a stored checkpoint that fits is restored, turn 1,
  KV and the node's and request's Mamba slots bit-exact there, the request bound to
  turn 1's node, and turn 2 is computed. Turn 1 longer than the host buffer streams;
  shorter, it goes through upstream's own staged prefetch; no checkpoint fits:
  declined. Negative control of the cut: the all-or-nothing device decision of before
  (`_device_fit` returning 0 when the whole hit does not fit) restores 0.
"""

from __future__ import annotations

import pytest
from sglang_l3 import metrics
from sglang_l3.patches.hicache import streamed_restore as sr
from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack

CONTEXT = 3072  # turn 1 + turn 2, ~2.8x the reader's host buffer (1088 tokens)
ARGS = {"hicache_ratio": 0.25}


def _all_or_nothing(orig):
    def fit(pipe, op, hit_tokens, **kw):
        got = orig(pipe, op, hit_tokens, **kw)
        return got if got == hit_tokens else 0

    return fit


@pytest.mark.all_seeds(core=("rust",), page=(64,))
@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("page", (1, 64))
@pytest.mark.parametrize(
    "turn1, free, mode",
    [
        (1536, 2048, "wait"),  # waits for the other request, then restores the whole hit
        (1536, 1024, "wait"),  # no checkpoint fits now: waits all the same
        (1536, 2048, "cut"),  # restorable part > host buffer: streamed
        (512, 1024, "cut"),  # restorable part fits the host buffer: upstream's path
        (1536, 1024, "cut"),  # no stored checkpoint fits: declined, recompute
        (1536, 2048, "all-or-nothing"),  # negative control of the cut: recompute
    ],
)
def test_short_device_pool_restores_the_longest_part_that_fits(
    tmp_path, monkeypatch, core: str, page: int, turn1: int, free: int, mode: str
) -> None:
    from sglang_l3.testing.scheduler_harness import SchedulerHarness

    seq = list(range(5, 5 + CONTEXT))
    writer = HybridSpec(page_size=page, kv_size=8192, max_context_len=4096)
    with L3Stack(writer, str(tmp_path), tree_core=core, server_args=ARGS) as w:
        want1 = w.write(seq[:turn1], marker=3.0)
        want2 = w.write(seq, marker=4.0)
        w.settle()
        assert not w.cache.buffer_pipeline.inflight_backup_pools
    if mode != "wait":
        monkeypatch.setattr(sr, "waits_for_rows", lambda cache, hit_tokens: False)
    if mode == "all-or-nothing":
        monkeypatch.setattr(sr, "_device_fit", _all_or_nothing(sr._device_fit))

    spec = HybridSpec(page_size=page, kv_size=4096, max_context_len=4096)
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args=ARGS) as st:
        cc = st.cache.cache_controller
        cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)
        assert cc.mem_pool_host.size < CONTEXT
        # Another request's KV holds the rest of the device pool (not evictable).
        hog = st.allocator.alloc(spec.kv_size - free)
        assert hog is not None and st.allocator.available_size() == free < CONTEXT
        st.scribble()
        h = SchedulerHarness(st, chunked_prefill_size=4096)
        c0 = metrics.snapshot()
        req = h.make_req(seq + [3, 4, 5])
        h.arrive(req)
        if mode == "wait":
            waited = "l3_stream_restore{waited_busy}"
            h.pump(lambda: metrics.get("l3_stream_restore", "waited_busy") > c0.get(waited, 0), "the hit parked")
            for _ in range(3):  # more ticks: it stays parked, holding nothing
                st.cache.check_hicache_events()
                assert not st.cache.check_prefetch_progress(req.cache_request_handle)
            assert not lane_of(st.cache.buffer_pipeline).streams
            assert st.allocator.available_size() == free, "a parked hit holds no rows"
            st.allocator.free(hog)  # the other request finishes
            h.wait_prefetch(req)
        else:
            h.wait_prefetch(req)
            st.allocator.free(hog)  # the other request finishes
        c1 = metrics.snapshot()
        delta = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1}
        batch = h.admit()
        assert batch is not None and req in batch.reqs
        if mode == "wait":
            assert req.prefix_len == CONTEXT, (req.prefix_len, delta)
            assert delta.get(waited) == 1, delta
            assert not delta.get("l3_stream_restore{truncated_device}"), delta
            assert not delta.get("l3_stream_restore{declined_device_short}"), delta
            h.pump(lambda: not st.cache.buffer_pipeline.ongoing_buffer_load_back, "load-back ack")
            m = st.match(seq)
            assert m.device_prefix_len == CONTEXT
            got = st.snapshot(m.last_device_node, st.node_mamba_slot(m.last_device_node))
            k, v = st.expected_kv(seq)
            assert got.k.equal(k) and got.v.equal(v), "restored KV differs"
            assert got.equal(want2), "node Mamba slot differs from turn 2's checkpoint"
            slot = int(req.kv.mamba_pool_idx)
            assert all(a.equal(b) for a, b in zip(h.mamba_state(slot), want2.mamba, strict=True)), (
                "request Mamba slot differs"
            )
        elif mode == "all-or-nothing" or free < turn1:
            assert req.prefix_len == 0, "the stream must be declined"
            assert delta.get("l3_stream_restore{declined_device_short}") == 1
            assert not delta.get("l3_stream_restore{truncated_device}")
        else:
            assert req.prefix_len == turn1, (req.prefix_len, turn1)
            assert delta.get("l3_stream_restore{truncated_device}") == 1
            streamed = turn1 > cc.mem_pool_host.size
            assert bool(delta.get("l3_stream_restore{started}")) == streamed
            h.pump(lambda: not st.cache.buffer_pipeline.ongoing_buffer_load_back, "load-back ack")
            m = st.match(seq[:turn1])
            assert m.device_prefix_len == turn1
            assert req.last_node == m.last_device_node, "request not bound to turn 1's node"
            node_slot = st.node_mamba_slot(m.last_device_node)
            assert node_slot is not None
            got = st.snapshot(m.last_device_node, node_slot)
            k, v = st.expected_kv(seq[:turn1])
            assert got.k.equal(k) and got.v.equal(v), "restored KV differs"
            assert got.equal(want1), "node Mamba slot differs from turn 1's checkpoint"
            slot = int(req.kv.mamba_pool_idx)
            assert slot != node_slot
            assert all(a.equal(b) for a, b in zip(h.mamba_state(slot), want1.mamba, strict=True)), (
                "request Mamba slot differs"
            )
            c2 = metrics.snapshot()
            assert c2.get("l3_restores", 0) == c0.get("l3_restores", 0) + 1
            assert c2.get("fail_stops", 0) == c0.get("fail_stops", 0)
        # The rest is computed: the request's rows hold the whole context's KV.
        h.forward(batch)
        rows = st.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :CONTEXT].long()
        layer = st.kv_pool.start_layer
        k, v = st.expected_kv(seq)
        assert st.kv_pool.get_key_buffer(layer)[rows].equal(k)
        assert st.kv_pool.get_value_buffer(layer)[rows].equal(v)
        h.finish(req)
        st.evict_all()
        st.settle()
        pipe = st.cache.buffer_pipeline
        assert not lane_of(pipe).streams
        assert pipe.anchor_locked_tokens_ == 0
        assert cc.prefetch_tokens_occupied == 0
        st.cache.sanity_check()
        assert st.pool_sizes() == st.baseline, "a pool did not return to its baseline"


@pytest.mark.parametrize("restart", (True, False), ids=("budget-restarts", "negative-control"))
def test_a_waiting_hit_keeps_its_timeout_budget(tmp_path, monkeypatch, restart: bool) -> None:
    """Under `--hicache-storage-prefetch-policy timeout` the budget is the store read's:
    a hit parked for device rows (longer than the whole budget here) is not cut off by
    it, and is restored whole once the rows go. Negative control: with the budget left
    running, the deadline expires while it waits and the request recomputes everything."""
    import time

    from sglang_l3.testing.scheduler_harness import SchedulerHarness

    page, free = 64, 1024
    seq = list(range(5, 5 + CONTEXT))
    writer = HybridSpec(page_size=page, kv_size=8192, max_context_len=4096)
    with L3Stack(writer, str(tmp_path), tree_core="rust", server_args=ARGS) as w:
        w.write(seq[:1536], marker=3.0)
        w.write(seq, marker=4.0)
        w.settle()
    if not restart:
        monkeypatch.setattr(sr, "_restart_budget", lambda cache, handle: None)
    spec = HybridSpec(page_size=page, kv_size=4096, max_context_len=4096)
    with L3Stack(spec, str(tmp_path), tree_core="rust", server_args=ARGS) as st:
        cache = st.cache
        cache.prefetch_stop_policy = "timeout"
        cache.prefetch_timeout_base, cache.prefetch_timeout_per_page = 0.3, 0.0
        hog = st.allocator.alloc(spec.kv_size - free)
        st.scribble()
        h = SchedulerHarness(st, chunked_prefill_size=4096)
        req = h.make_req(seq + [3, 4, 5])
        h.arrive(req)
        handle = req.cache_request_handle
        end = time.monotonic() + 1.5  # five budgets
        done = False
        while time.monotonic() < end and not done:
            cache.check_hicache_events()
            done = cache.check_prefetch_progress(handle)
            time.sleep(0.02)
        st.allocator.free(hog)
        if restart:
            assert not done, "the deadline cut off a hit waiting for device rows"
            # the read itself gets a budget a busy machine cannot miss
            cache._storage_prefetch_wait[handle].timeout_s = 600.0
            h.wait_prefetch(req)
        batch = h.admit()
        assert batch is not None and req in batch.reqs
        assert req.prefix_len == (CONTEXT if restart else 0), req.prefix_len
        h.forward(batch)
        h.finish(req)
        st.evict_all()
        st.settle()
        assert not lane_of(cache.buffer_pipeline).streams
        assert st.pool_sizes() == st.baseline, "a pool did not return to its baseline"
