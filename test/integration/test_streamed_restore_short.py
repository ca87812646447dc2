"""Streamed restore on a short device pool (`streamed-restore`, issue 11): when the
device pool cannot take the whole storage hit, the longest part ending at a stored
Mamba checkpoint that fits is restored and the request computes the rest.

Real upstream stack on CPU (`L3Stack`) and the real admission path
(`SchedulerHarness`: `_add_request_to_queue` → `_prefetch_kvcache` →
`_get_new_batch_prefill_raw`, `PrefillAdder.add_one_req`), page sizes 1 and 64, both tree cores. A
conversation is written in two turns (checkpoints at the end of turn 1 and of
turn 2); a fresh reader whose device pool is mostly held by another request
restores turn 1 only — KV and the node's and request's Mamba slots bit-exact at
the truncation point, the request bound to turn 1's node — and computes turn 2.
Turn 1 longer than the host buffer streams; shorter, it goes through upstream's
own staged prefetch. Negative control: the all-or-nothing device decision of
before (`_device_fit` returning 0 when the whole hit does not fit) restores 0.
"""

from __future__ import annotations

import pytest
from sglang_l3 import metrics
from sglang_l3.patches import streamed_restore as sr
from sglang_l3.patches.streamed_restore import lane_of
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack

CONTEXT = 3072  # turn 1 + turn 2, ~2.8x the reader's host buffer (1088 tokens)
ARGS = {"hicache_ratio": 0.25}


def _all_or_nothing(orig):
    def fit(pipe, op, hit_tokens):
        got = orig(pipe, op, hit_tokens)
        return got if got == hit_tokens else 0

    return fit


@pytest.mark.all_seeds(core=("rust",), page=(64,))
@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("page", (1, 64))
@pytest.mark.parametrize(
    "turn1, free, truncate",
    [
        (1536, 2048, True),  # restorable part > host buffer: streamed
        (512, 1024, True),  # restorable part fits the host buffer: upstream's path
        (1536, 1024, True),  # no stored checkpoint fits: declined, recompute
        (1536, 2048, False),  # negative control: all-or-nothing → recompute
    ],
)
def test_short_device_pool_restores_the_longest_part_that_fits(
    tmp_path, monkeypatch, core: str, page: int, turn1: int, free: int, truncate: bool
) -> None:
    from sglang_l3.testing.scheduler_harness import SchedulerHarness

    seq = list(range(5, 5 + CONTEXT))
    writer = HybridSpec(page_size=page, kv_size=8192, max_context_len=4096)
    with L3Stack(writer, str(tmp_path), tree_core=core, server_args=ARGS) as w:
        want1 = w.write(seq[:turn1], marker=3.0)
        w.write(seq, marker=4.0)
        w.settle()
        assert not w.cache.buffer_pipeline.inflight_backup_pools
    if not truncate:
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
        h.wait_prefetch(req)
        c1 = metrics.snapshot()
        delta = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1}
        # The other request finishes; ours is admitted.
        st.allocator.free(hog)
        batch = h.admit()
        assert batch is not None and req in batch.reqs
        if not truncate or free < turn1:
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
            assert all(a.equal(b) for a, b in zip(h.mamba_state(slot), want1.mamba)), "request Mamba slot differs"
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
