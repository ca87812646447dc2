"""A streamed restore that rows held for queued L3 writes keep from fitting waits for
them instead of being cut (patches `write-guard` and `streamed-restore`).

Real upstream stack on CPU (`L3Stack`) and the real admission path (`SchedulerHarness`),
page 64, both tree cores. A 3,072-token conversation (checkpoints at 1,536 and 3,072)
is in the store; a fresh reader (device pool 4,096, host buffer ~1,088: the hit streams)
has just computed another 2,048-token context whose L3 write is still queued, so those
rows stay on the device (the guard). The hit waits, parked (`waited_write`), the other
context's write stages, its rows become evictable and the whole hit is restored:
KV bit-exact, the request's Mamba slot equal to the 3,072 checkpoint, nothing cut, and
the other context is in the store too. Negative control: with the wait off (a hit the
device cannot take now is cut, as before) the hit is cut to the 1,536 checkpoint
(`truncated_device`).
"""

from __future__ import annotations

import pytest
from sglang_l3 import metrics
from sglang_l3.patches.hicache import streamed_restore as sr
from sglang_l3.patches.hicache import write_guard
from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack

PAGE = 64
CONTEXT = 3072
TURN1 = 1536
OTHER = 2048
ARGS = {"hicache_ratio": 0.25}


def _hold_writes_until_the_fit_is_decided(monkeypatch, pipe) -> None:
    """The other context's write stays queued (its rows guarded) until the hit's
    device fit is decided, then stages as usual. Without the hold the precondition is
    a race: on a loaded machine the write could stage and free its rows before the
    hit's stream starts, and then neither the wait nor the cut happens (seen once
    under seed 2 in a full run: the control restored all 3,072 tokens)."""
    held = [True]
    flush = pipe.flush_pending_writes
    fit = sr._device_fit

    def held_flush() -> None:
        if not held[0]:
            flush()

    def decided(*args, **kwargs):
        try:
            return fit(*args, **kwargs)
        finally:
            held[0] = False

    monkeypatch.setattr(pipe, "flush_pending_writes", held_flush)
    monkeypatch.setattr(sr, "_device_fit", decided)


@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("wait", (True, False), ids=("wait", "negative-control"))
def test_a_hit_waits_for_rows_held_by_queued_writes(tmp_path, monkeypatch, core: str, wait: bool) -> None:
    from sglang_l3.testing.scheduler_harness import SchedulerHarness

    seq = list(range(5, 5 + CONTEXT))
    other = list(range(20000, 20000 + OTHER))
    writer = HybridSpec(page_size=PAGE, kv_size=8192, max_context_len=4096)
    with L3Stack(writer, str(tmp_path), tree_core=core, server_args=ARGS) as w:
        w.write(seq[:TURN1], marker=3.0)
        want = w.write(seq, marker=4.0)
        w.settle()
    if not wait:
        monkeypatch.setattr(sr, "waits_for_rows", lambda cache, hit_tokens: False)

    spec = HybridSpec(page_size=PAGE, kv_size=4096, max_context_len=4096)
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args=ARGS) as st:
        cc = st.cache.cache_controller
        pipe = st.cache.buffer_pipeline
        cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)
        assert cc.mem_pool_host.size < CONTEXT
        st.write(other, marker=5.0, flush=False)
        assert pipe.pending_write_queue and write_guard.guarded_nodes(pipe)
        _hold_writes_until_the_fit_is_decided(monkeypatch, pipe)
        assert st.allocator.available_size() < CONTEXT
        st.scribble()
        h = SchedulerHarness(st, chunked_prefill_size=4096)
        c0 = metrics.snapshot()
        req = h.make_req(seq + [3, 4, 5])
        h.arrive(req)
        h.wait_prefetch(req)
        # (the other context's write stages meanwhile; admission needs its rows too)
        h.pump(lambda: not pipe.pending_write_queue and not pipe.ongoing_write_through, "writes staged")
        batch = h.admit()
        assert batch is not None and req in batch.reqs
        delta = {k: v - c0.get(k, 0) for k, v in metrics.snapshot().items()}
        if not wait:
            assert req.prefix_len == TURN1, req.prefix_len
            assert delta.get("l3_stream_restore{truncated_device}") == 1
        else:
            assert req.prefix_len == CONTEXT, (req.prefix_len, delta)
            assert delta.get("l3_stream_restore{waited_write}") == 1
            assert not delta.get("l3_stream_restore{truncated_device}")
            assert not delta.get("l3_write_dropped{evicted}")
            h.pump(lambda: not pipe.ongoing_buffer_load_back, "load-back ack")
            m = st.match(seq)
            assert m.device_prefix_len == CONTEXT
            got = st.snapshot(m.last_device_node, st.node_mamba_slot(m.last_device_node))
            k, v = st.expected_kv(seq)
            assert got.k.equal(k) and got.v.equal(v), "restored KV differs"
            slot = int(req.kv.mamba_pool_idx)
            assert all(a.equal(b) for a, b in zip(h.mamba_state(slot), want.mamba, strict=True)), (
                "request Mamba slot differs"
            )
        h.forward(batch)
        h.finish(req)
        st.settle(timeout=120)
        st.evict_all()
        st.settle()
        assert not lane_of(pipe).streams and cc.prefetch_tokens_occupied == 0
        assert not write_guard.guarded_nodes(pipe)
        assert st.pool_sizes() == st.baseline, "a pool did not return to its baseline"
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args={"hicache_ratio": 1.0}) as r:
        hh, loaded = r.prefetch(other, "other")
        if r.cache.buffer_pipeline.has_staged(hh):
            r.cache.buffer_pipeline.release_staged_hold(hh)
        r.settle()
        assert loaded == OTHER, "the other context's guarded write must reach the store whole"
