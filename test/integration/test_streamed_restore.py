"""Streamed L3 restore (`streamed-restore`, issue 11): a storage hit larger than
the host staging buffer restores in rounds through that buffer.

Real upstream stack on CPU (`L3Stack`), Mamba hybrid, buffer-only, our store.
A writer with a small host buffer writes a context (`streamed-write`); a fresh
reader (a restart) with the same small buffer restores it: contexts 2x, 8x and
30x the buffer, page sizes 1 and 64, both tree cores; KV of every token, the
node's and the request's Mamba state bit-exact; the request bound to the node
restored over all pieces (re-anchor's checks, `l3_restores` +1); every pool back
at baseline. Lifecycle: abort mid-stream and after staging, a store read failing
in piece k (recompute, beliefs healed, a later write + restore is whole), two
requests streaming through one small buffer at once. Negative control: with the
patch undone, the 8x context restores 0 (`declined_host_oversize`).
"""

from __future__ import annotations

import os
import time

import pytest
from sglang_l3 import metrics
from sglang_l3.patches.hicache.streamed_restore import lane_of, piece_size
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack
from streamed_support import BUFFER, back_to_baseline, context, make_spec, pump, reader, write


@pytest.mark.all_seeds(times=(2, 8), page_size=(64,))
@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("page_size", (1, 64))
@pytest.mark.parametrize("times", (2, 8, 30))
def test_restore_through_small_buffer(tmp_path, times: int, page_size: int, core: str) -> None:
    spec = make_spec(page_size, times * (BUFFER + page_size))
    seq = context(spec, times)
    (want,) = write(spec, tmp_path, core, [seq])
    with reader(spec, tmp_path, core) as st:
        host = st.cache.cache_controller.mem_pool_host.size
        assert len(seq) >= times * host, "the context must be `times` x the host buffer"
        c0 = metrics.snapshot()
        st.scribble()
        req, loaded = st.restore(seq, "long")
        st.check_restored(seq, req, loaded, want, kv=True)
        c1 = metrics.snapshot()
        delta = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1}
        assert delta.get("l3_stream_restore{started}") == 1
        assert delta.get("l3_stream_restore{restored}") == 1
        # rounds of piece_size (what restore_bench's piece-shaped store read assumes), the
        # last one through upstream's prefetch
        pieces = -(-loaded // piece_size(host, page_size)) - 1
        assert delta.get("l3_stream_restore_pieces", 0) == pieces >= times - 2, (delta, pieces)
        assert delta.get("l3_restores") == 1 and not delta.get("fail_stops")
        st.cache.sanity_check()
        back_to_baseline(st, req)


@pytest.mark.parametrize("without", ["streamed-restore"], indirect=True)
def test_without_patch_8x_restores_nothing(tmp_path, without) -> None:
    spec = make_spec(64, 8 * (BUFFER + 64))
    seq = context(spec, 8)
    write(spec, tmp_path, "rust", [seq])
    with reader(spec, tmp_path, "rust") as st:
        declined = st.cache._prefetch_outcome_stats["declined_host_oversize"]
        h, loaded = st.prefetch(seq, "long")
        assert loaded == 0 and not st.cache.buffer_pipeline.has_staged(h)
        assert st.cache._prefetch_outcome_stats["declined_host_oversize"] == declined + 1
        back_to_baseline(st)


@pytest.mark.all_seeds(core=("rust",))
@pytest.mark.parametrize("core", TREE_CORES)
def test_abort_mid_stream_and_when_staged(tmp_path, core: str) -> None:
    spec = make_spec(64, 8 * (BUFFER + 64))
    seq = context(spec, 8)
    (want,) = write(spec, tmp_path, core, [seq])
    with reader(spec, tmp_path, core) as st:
        pipe = st.cache.buffer_pipeline
        lane = lane_of(pipe)
        # 1) abort while pieces are in flight / landed
        h = st.start_prefetch(seq, "a1")
        pump(
            st,
            lambda: h in lane.streams and lane.streams[h].landed_pages >= 1,
            "a landed piece",
        )
        assert lane.streams[h].state == "reading"
        st.cache.release_aborted_request(h)
        pump(st, lambda: not lane.streams, "aborted stream to end")
        back_to_baseline(st)
        # 2) abort after the final round staged (R held privately)
        h, loaded = st.prefetch(seq, "a2")
        assert loaded == len(seq) and pipe.has_staged(h)
        assert lane.streams[h].state == "staged"
        st.cache.release_aborted_request(h)
        assert not lane.streams
        back_to_baseline(st)
        # 3) the same reader restores it whole afterwards
        st.scribble()
        req, loaded = st.restore(seq, "a3")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)


def kv_page_path(st: L3Stack, page_hash: str) -> str:
    backend = st.cache.cache_controller.storage_backend
    name = next(k for k in backend._specs if k != "mamba")
    return backend.store.path_of(page_hash, backend._specs[name])


@pytest.mark.all_seeds(core=("rust",))
@pytest.mark.parametrize("core", TREE_CORES)
def test_store_read_failing_in_piece_k(tmp_path, core: str) -> None:
    spec = make_spec(64, 8 * (BUFFER + 64))
    seq = context(spec, 8)
    (want,) = write(spec, tmp_path, core, [seq])
    with reader(spec, tmp_path, core) as st:
        lane = lane_of(st.cache.buffer_pipeline)
        errors = metrics.get("l3_stream_restore", "storage_error")
        h = st.start_prefetch(seq, "broken")
        pump(st, lambda: h in lane.streams, "the stream to start")
        s = lane.streams[h]
        k = 3  # a piece not yet submitted (two are in flight at most)
        victim = s.keys[k * s.piece_pages]
        assert s.next_page <= k * s.piece_pages
        path = kv_page_path(st, victim)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        pump(
            st,
            lambda: st.cache.check_prefetch_progress(h),
            "the request to be released",
        )
        assert not st.cache.buffer_pipeline.has_staged(h), "a broken stream must not stage"
        pump(st, lambda: not lane.streams, "the stream to end")
        assert metrics.get("l3_stream_restore", "storage_error") == errors + 1
        st.cache.pop_prefetch_loaded_tokens(h)
        back_to_baseline(st)
    # The prefix is recomputed and written again; then it restores whole.
    (want,) = write(spec, tmp_path, core, [seq])
    with reader(spec, tmp_path, core) as st:
        st.scribble()
        req, loaded = st.restore(seq, "healed")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)


@pytest.mark.all_seeds(core=("rust",))
@pytest.mark.parametrize("core", TREE_CORES)
def test_two_streams_through_one_buffer(tmp_path, core: str) -> None:
    spec = make_spec(64, 8 * (BUFFER + 64))
    a = context(spec, 3, start=11)
    b = context(spec, 3, start=50_000)
    want_a, want_b = write(spec, tmp_path, core, [a, b])
    with reader(spec, tmp_path, core) as st:
        pipe = st.cache.buffer_pipeline
        st.scribble()
        ha = st.start_prefetch(a, "A")
        hb = st.start_prefetch(b, "B")
        # A third context written meanwhile shares the same host buffer.
        c = context(spec, 2, start=90_000)
        want_c = st.write(c, marker=9.0, flush=False)
        pump(
            st,
            lambda: pipe.has_staged(ha) and pipe.has_staged(hb),
            "both streams to stage",
            timeout=300,
        )
        assert st.cache.check_prefetch_progress(ha) and st.cache.check_prefetch_progress(hb)
        assert st.cache.pop_prefetch_loaded_tokens(ha) == len(a)
        assert st.cache.pop_prefetch_loaded_tokens(hb) == len(b)
        st.flush_backups()
        req_a, la = st.admit(ha, a, "A")
        req_b, lb = st.admit(hb, b, "B")
        st.check_restored(a, req_a, la, want_a, kv=True)
        st.check_restored(b, req_b, lb, want_b, kv=True)
        back_to_baseline(st, req_a, req_b)
    with reader(spec, tmp_path, core) as st:
        st.scribble()
        req, loaded = st.restore(c, "C")
        st.check_restored(c, req, loaded, want_c, kv=True)
        back_to_baseline(st, req)


@pytest.mark.all_seeds(core=("python",))
@pytest.mark.parametrize("core", TREE_CORES)
def test_users_case_through_real_admission(tmp_path, core: str) -> None:
    """The issue's server case on the real admission path (`SchedulerHarness`:
    `_add_request_to_queue` → `_prefetch_kvcache` → `_get_new_batch_prefill_raw`,
    `PrefillAdder.add_one_req`): device pool 4096, page 64, `hicache_ratio` 0.25
    (host pool 1088), a 1792-token context written by one process and admitted by
    a fresh one with the whole context from L3, then extended."""
    from sglang_l3.testing.scheduler_harness import SchedulerHarness

    spec = HybridSpec(page_size=64, kv_size=4096, max_context_len=4096)
    args = {"hicache_ratio": 0.25}
    seq = list(range(5, 5 + 1792))
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args=args) as w:
        want = w.write(seq, marker=4.0)
        w.settle()
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args=args) as st:
        cc = st.cache.cache_controller
        cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)
        assert 2 * cc.mem_pool_host.size > len(seq) > cc.mem_pool_host.size
        st.scribble()
        h = SchedulerHarness(st, chunked_prefill_size=4096)
        c0 = metrics.snapshot()
        req = h.make_req(seq + [3, 4, 5])
        h.arrive(req)
        h.wait_prefetch(req)
        batch = h.admit()
        assert batch is not None and req in batch.reqs
        assert req.prefix_len == len(seq), (req.prefix_len, len(seq))
        c1 = metrics.snapshot()
        assert c1.get("l3_stream_restore{restored}", 0) == c0.get("l3_stream_restore{restored}", 0) + 1
        assert c1.get("l3_restores", 0) == c0.get("l3_restores", 0) + 1
        assert c1.get("fail_stops", 0) == c0.get("fail_stops", 0)
        h.forward(batch)
        m = st.match(seq)
        assert m.device_prefix_len == len(seq)
        k, v = st.expected_kv(seq)
        got = st.snapshot(m.last_device_node, st.node_mamba_slot(m.last_device_node))
        assert got.k.equal(k) and got.v.equal(v) and got.equal(want)
        slot = int(req.kv.mamba_pool_idx)
        assert all(a.equal(b) for a, b in zip(h.mamba_state(slot), want.mamba, strict=True)), (
            "request Mamba slot differs"
        )
        h.finish(req)
        st.settle()
        assert not lane_of(st.cache.buffer_pipeline).streams


@pytest.mark.all_seeds(credit=(True,))
@pytest.mark.parametrize("credit", [True, False])
def test_tight_device_pool_admits_with_the_row_credit(tmp_path, credit: bool) -> None:
    """Device pool 2560, context 1792: R (1536 rows) is allocated while streaming,
    so upstream's budget (which charges the whole span as new tokens) sees only
    1024 free. With the credit the request is admitted with its whole prefix;
    without it (control) the staged hold is deferred at admission."""
    from sglang_l3.patches import framework
    from sglang_l3.testing.scheduler_harness import SchedulerHarness

    spec = HybridSpec(page_size=64, kv_size=2560, max_context_len=2560)
    args = {"hicache_ratio": 0.25}
    seq = list(range(5, 5 + 1792))
    with L3Stack(spec, str(tmp_path), server_args=args) as w:
        w.write(seq, marker=4.0)
        w.settle()
    with L3Stack(spec, str(tmp_path), server_args=args) as st:
        cc = st.cache.cache_controller
        cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)
        h = SchedulerHarness(st, chunked_prefill_size=4096)
        req = h.make_req(seq + [3, 4, 5])
        h.arrive(req)
        h.wait_prefetch(req)
        s = lane_of(st.cache.buffer_pipeline).streams[req.cache_request_handle]
        assert st.allocator.available_size() < len(seq) <= st.allocator.available_size() + s.r_tokens
        import sglang.srt.managers.schedule_policy as sp

        hooked = sp.PrefillAdder.add_one_req
        if not credit:  # upstream's own, under streamed-restore's hook (and any stacked on it)
            fn = hooked
            while getattr(fn, "__sglang_l3_patch__", None) != "streamed-restore":
                fn = fn.__sglang_l3_original__
            sp.PrefillAdder.add_one_req = fn.__sglang_l3_original__
        try:
            batch = h.admit()
        finally:
            sp.PrefillAdder.add_one_req = hooked
        assert framework.is_applied("streamed-restore")
        if credit:
            assert batch is not None and req in batch.reqs and req.prefix_len == len(seq)
            h.forward(batch)
            h.finish(req)
        else:
            assert batch is None or req not in batch.reqs
            assert st.cache.buffer_pipeline._staged_admission_defers.get(req.cache_request_handle, 0) >= 1
            h.abort_queued(req)
        st.settle()
        assert not lane_of(st.cache.buffer_pipeline).streams


def test_decisions_do_not_depend_on_store_timing(tmp_path, monkeypatch) -> None:
    """TP ranks see different store latencies; every decision must come out the
    same (TP=2 cannot start on CPU). The pieces a stream reads (page bounds, in
    order) and the rows it lands (in order) under a fast and a slow store are
    identical, and so is the result. (Which tick a piece lands in may differ
    between runs; within a run every rank lands it in the same tick, the
    completion flags being MIN-reduced.)"""
    import sglang_l3.patches.hicache.streamed_restore as sr

    spec = make_spec(64, 8 * (BUFFER + 64))
    seq = context(spec, 8)
    (want,) = write(spec, tmp_path, "rust", [seq])
    read, copy, launch = sr._read_piece, sr._copy_to_device, sr._launch_reads

    def run(delay: float) -> tuple[list, list]:
        reads: list = []
        lands: list = []

        def slow_read(cc, op, keys, host, prefix):
            time.sleep(delay)
            return read(cc, op, keys, host, prefix)

        def traced_copy(cc, host, rows, rows_host):
            lands.append((int(rows[0]) if len(rows) else -1, len(rows)))
            return copy(cc, host, rows, rows_host)

        monkeypatch.setattr(sr, "_read_piece", slow_read)
        monkeypatch.setattr(sr, "_copy_to_device", traced_copy)
        with reader(spec, tmp_path, "rust") as st:
            lane = lane_of(st.cache.buffer_pipeline)

            def traced_launch(pipe, s):
                before = len(s.pieces)
                launch(pipe, s)
                reads.extend((pc.first_page, pc.pages) for pc in list(s.pieces)[before:])

            monkeypatch.setattr(sr, "_launch_reads", traced_launch)
            st.scribble()
            req, loaded = st.restore(seq, "t")
            st.check_restored(seq, req, loaded, want, kv=True)
            back_to_baseline(st, req)
            assert not lane.streams
        return reads, lands

    fast, slow = run(0.0), run(0.05)
    assert fast == slow and len(fast[0]) > 4


@pytest.mark.parametrize("core", TREE_CORES)
def test_final_round_waits_for_a_busy_mamba_staging_slot(tmp_path, core: str) -> None:
    """The last piece and the Mamba checkpoint come through upstream's own prefetch, which
    parks when the host has no Mamba staging slot free, as while another agent's turn is
    written to L3 (agent_switch, CI 2026-12-06: 0 tokens restored). The stream keeps its
    rows and retries the final round once the slot is back: the whole context restores,
    bit-exact. Before, upstream parked it after the stream had trimmed the op past the tree;
    its retry found no anchor (`anchor_lost`), the prefetch ended, and the request would
    have recomputed its whole context."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    spec = make_spec(64, 8 * (BUFFER + 64))
    seq = context(spec, 8)
    (want,) = write(spec, tmp_path, core, [seq])
    with reader(spec, tmp_path, core) as st:
        pipe = st.cache.buffer_pipeline
        lane = lane_of(pipe)
        mamba_host = st.cache.components[ComponentType.MAMBA]._mamba_pool_host
        c0 = metrics.snapshot()
        st.scribble()
        h = st.start_prefetch(seq, "busy")
        pump(st, lambda: h in lane.streams and lane.streams[h].landed_pages >= 1, "a landed piece")
        held = mamba_host.alloc(mamba_host.available_size())  # what a queued write's staging holds
        assert held is not None and mamba_host.available_size() == 0
        pump(st, lambda: lane.streams[h].final_waited, "the final round to find no Mamba slot")
        for _ in range(20):  # parked, retried every tick, never aborted
            st.cache.check_hicache_events()
            assert h in lane.streams and lane.streams[h].state == "ready"
        mamba_host.free(held)
        bp = st.cache.buffer_pipeline
        pump(st, lambda: st.cache.check_prefetch_progress(h) and bp.has_staged(h), "the restore to stage")
        st.cache.pop_prefetch_loaded_tokens(h)
        req, loaded = st.admit(h, seq, "busy")
        st.check_restored(seq, req, loaded, want, kv=True)
        delta = {k: v - c0.get(k, 0) for k, v in metrics.snapshot().items()}
        assert delta.get("l3_stream_restore{final_waited}") == 1
        assert delta.get("l3_stream_restore{restored}") == 1 and not delta.get("l3_stream_restore{aborted}")
        back_to_baseline(st, req)
