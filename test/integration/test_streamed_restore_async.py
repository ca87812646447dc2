"""The streamed restore's piece copies on an asynchronous device (issue 22).

On the simulated device (`sglang_l3.sim.harness`, every seed of the conftest) copies
queued on a side stream run only when something waits for them, and a forward pass in
flight writes when the forward stream is drained. The piece copies host -> private
rows R are queued on upstream's load stream behind the forward stream:

- a forward still writing rows that were freed and then taken as R (overlap
  scheduling) lands before the copy, not after it (the fence; the test fault
  SGLANG_L3_TEST_FAULT=skip-load-fence removes it and this test fails);
- the scheduler thread issues a copy and moves on: after the tick the copy is still
  queued, and its host slots are freed only once the copy completed;
- rows R given back by an aborted stream return to the allocator only once the
  copies into them completed.

With SGLANG_L3_TEST_DEVICE=cuda the first runs on the GPU (its forward stream kept
busy, so an unfenced copy lands first); the others watch the simulator's queues and
are skipped there.
"""

from __future__ import annotations

import pytest
import sglang_l3.patches.hicache.streamed_restore as sr
from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.sim import streams as sim_streams
from sglang_l3.testing.device import on_gpu
from streamed_support import back_to_baseline, context, make_spec, pump, reader, write

pytestmark = pytest.mark.all_seeds()


def _stream_of(st, h):
    lane = lane_of(st.cache.buffer_pipeline)
    pump(st, lambda: h in lane.streams, "the stream to start")
    return lane.streams[h]


@pytest.mark.parametrize("page_size", (1, 64))
def test_a_forward_in_flight_lands_before_the_piece_copy(tmp_path, page_size: int) -> None:
    spec = make_spec(page_size, 8 * (256 + page_size))
    seq = context(spec, 8)
    (want,) = write(spec, tmp_path, "rust", [seq])
    with reader(spec, tmp_path, "rust") as st:
        assert on_gpu() or sim_streams.installed()
        st.scribble()
        freed = st.inflight_forward_write_then_free()
        assert st.forward_busy()
        h = st.start_prefetch(seq, "r")
        s = _stream_of(st, h)
        assert set(s.rows.tolist()) <= set(freed.tolist()), "R must be rows a forward in flight still writes"
        bp = st.cache.buffer_pipeline
        pump(st, lambda: st.cache.check_prefetch_progress(h) and bp.has_staged(h), "the stream to stage")
        assert st.cache.pop_prefetch_loaded_tokens(h) == len(seq)
        # admit(): the forward reads R behind upstream's per-layer waits, before the ack.
        req, loaded = st.admit(h, seq, "r")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)


@pytest.mark.sim_only  # watches the simulated device's queues
def test_the_scheduler_moves_on_while_a_piece_copy_is_queued(tmp_path, monkeypatch) -> None:
    spec = make_spec(64, 8 * (256 + 64))
    seq = context(spec, 8)
    (want,) = write(spec, tmp_path, "rust", [seq])
    issued: list = []
    copy, free_piece = sr._copy_to_device, sr._free_piece

    def traced_copy(cc, host, rows, rows_host):
        ev = copy(cc, host, rows, rows_host)
        issued.append(ev)
        return ev

    def checked_free(pipe, pc):
        # A piece's host slots are reused by the next read: only once its copy ran.
        assert pc.copied is None or pc.copied.done(), "host slots freed while their copy is queued"
        free_piece(pipe, pc)

    monkeypatch.setattr(sr, "_copy_to_device", traced_copy)
    monkeypatch.setattr(sr, "_free_piece", checked_free)
    with reader(spec, tmp_path, "rust") as st:
        st.scribble()
        load = st.cache.cache_controller.l2_transfer_engine.host_to_device_stream
        queued_after_tick = 0
        events = st.cache.check_hicache_events

        def tick() -> None:
            """One scheduler tick, wherever the test runs one (also while waiting for the
            stream to start: a fast first read is copied there); it returns without the copy."""
            nonlocal queued_after_tick
            before = len(issued)
            events()
            for ev in issued[before:]:
                queued_after_tick += not ev.done()
                assert "kv-load" in load.pending()

        monkeypatch.setattr(st.cache, "check_hicache_events", tick)
        h = st.start_prefetch(seq, "r")
        s = _stream_of(st, h)
        bp = st.cache.buffer_pipeline
        while not (st.cache.check_prefetch_progress(h) and bp.has_staged(h)):
            before = len(issued)
            st.cache.check_hicache_events()
            if len(issued) > before:
                assert s.copying and s.copying[-1].copied is issued[-1]
        assert len(issued) >= 6 and queued_after_tick == len(issued), "every copy was still queued after its tick"
        st.cache.pop_prefetch_loaded_tokens(h)
        req, loaded = st.admit(h, seq, "r")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)


@pytest.mark.sim_only  # watches the simulated device's queues
def test_aborted_rows_return_only_after_their_copies(tmp_path, monkeypatch) -> None:
    spec = make_spec(64, 8 * (256 + 64))
    seq = context(spec, 8)
    write(spec, tmp_path, "rust", [seq])
    with reader(spec, tmp_path, "rust") as st:
        lane = lane_of(st.cache.buffer_pipeline)
        h = st.start_prefetch(seq, "a")
        s = _stream_of(st, h)
        pump(st, lambda: s.copying and not s.copying[-1].copied.done(), "a piece copy in flight")
        rows = set(s.rows.tolist())
        allocator = st.allocator
        free = allocator.free
        early: list = []

        def checked(idx):
            if rows & set(idx.tolist()) and any(not pc.copied.done() for pc in s.copying) | any(
                not r.copied.done() for r in lane.retiring
            ):
                early.append(len(idx))
            return free(idx)

        monkeypatch.setattr(allocator, "free", checked)
        st.cache.release_aborted_request(h)
        pump(st, lambda: not lane.streams and not lane.retiring, "the aborted stream to retire")
        monkeypatch.setattr(allocator, "free", free)
        assert not early, "rows R returned to the allocator while a copy into them was queued"
        back_to_baseline(st)


@pytest.mark.sim_only  # watches the simulated device's queues
def test_no_piece_copy_reads_device_indices(tmp_path, monkeypatch) -> None:
    """Issue 33 item 2: on io backend `direct` (the stack's, as `cli-buffer-only` sets on
    ROCm) upstream's `move_indices` reads the device indices to host, a device sync on the
    scheduler thread. A piece copy hands R's host copy, taken once at the stream's start:
    the simulated device counts no device->host read in any piece copy."""
    spec = make_spec(64, 8 * (256 + 64))
    seq = context(spec, 8)
    (want,) = write(spec, tmp_path, "rust", [seq])
    reads: list[int] = []
    copy = sr._copy_to_device

    def counted_copy(cc, host, rows, rows_host):
        before = sim_streams.stats()["device_reads"]
        ev = copy(cc, host, rows, rows_host)
        reads.append(sim_streams.stats()["device_reads"] - before)
        return ev

    monkeypatch.setattr(sr, "_copy_to_device", counted_copy)
    with reader(spec, tmp_path, "rust") as st:
        assert st.cache.cache_controller.io_backend == "direct"
        st.scribble()
        h = st.start_prefetch(seq, "r")
        bp = st.cache.buffer_pipeline
        pump(st, lambda: st.cache.check_prefetch_progress(h) and bp.has_staged(h), "the stream to stage")
        assert st.cache.pop_prefetch_loaded_tokens(h) == len(seq)
        req, loaded = st.admit(h, seq, "r")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)
    assert len(reads) >= 2, "the restore was not streamed in pieces"
    assert reads == [0] * len(reads), f"device->host index reads per piece copy: {reads}"
