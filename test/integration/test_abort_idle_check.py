"""Issue 48: an abort at any point of a streamed restore never leaves device rows that
upstream's strict idle leak check cannot see.

`Scheduler.on_idle` checks the pools whenever `Scheduler.is_fully_idle` holds, and with
SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE (on by default) a row that is neither free,
evictable, protected nor a session's stops the scheduler. A streamed restore aborted
while it still held its private rows R (reads or copies in flight) ended only at a
later tick, while upstream's pipeline already called itself idle: the TP=2 server died
with `pool memory leak detected! [full] total=4096, available=1536` (R = 2,560 rows).

Real upstream stack on CPU under the simulated device (acks lag), both tree cores: the
request is aborted (upstream's `release_aborted_request`, what `/abort_request`, a
client disconnect and the scheduler's own timeout abort all reach) after 0, 1, 2, n-1
and n of its n pieces landed, once its final round staged, and while its hit waits
parked for device rows (`waited_busy`). After every tick until the stream is gone,
upstream's idle predicate and pool check run as `on_idle` runs them
(`sglang_l3.testing.idle_check`); at the end the scheduler is idle and every pool is
back at its baseline. Negative control: with the fix undone (patch streamed-restore's
`BufferModePipeline.is_idle` hook), the same sequence fails the check.
"""

from __future__ import annotations

import pytest
from sglang_l3 import metrics
from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.testing import idle_check
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack, wait_for_work
from streamed_support import back_to_baseline

BUFFER = 256  # host KV pool target (tokens): pieces of 2 pages at page 64
PAGE = 64
TIMES = 8  # the context is 8x the host buffer: 40 pages, 20 pieces
POINTS = ("k0", "k1", "k2", "n-1", "n", "staged")


def _spec() -> HybridSpec:
    context = TIMES * (BUFFER + PAGE)
    return HybridSpec(page_size=PAGE, kv_size=2 * context + 1024, max_context_len=context + 256)


def _context(start: int = 11) -> list[int]:
    return list(range(start, start + TIMES * (BUFFER + PAGE)))


def _stack(spec: HybridSpec, tmp_path, core: str) -> L3Stack:
    return L3Stack(spec, str(tmp_path), tree_core=core, server_args={"hicache_ratio": BUFFER / spec.kv_size})


def _write(spec: HybridSpec, tmp_path, core: str, seq: list[int]) -> None:
    with _stack(spec, tmp_path, core) as w:
        w.write(seq, marker=3.0)
        w.settle()


def _tick_until(st: L3Stack, cond, what: str, passes: int = 20000) -> None:
    """Tick as the scheduler loop does, running upstream's idle check after each tick."""
    for _ in range(passes):
        st.cache.check_hicache_events()
        idle_check.check(st, what)
        if cond():
            return
        wait_for_work(st.cache)
    raise AssertionError(f"not reached: {what}")


def _reached(st: L3Stack, h, point: str) -> bool:
    s = lane_of(st.cache.buffer_pipeline).streams.get(h)
    if point == "staged":
        return st.cache.buffer_pipeline.has_staged(h)
    if s is None:
        return False
    piece = s.piece_pages
    want = {"k0": 0, "k1": piece, "k2": 2 * piece, "n-1": len(s.keys) - piece, "n": len(s.keys)}[point]
    return s.landed_pages >= want


def _abort_and_drain(st: L3Stack, h) -> None:
    lane = lane_of(st.cache.buffer_pipeline)
    st.cache.release_aborted_request(h)
    _tick_until(
        st,
        lambda: not lane.streams and not lane.retiring and idle_check.fully_idle(st),
        "the aborted stream to end",
    )
    assert idle_check.check(st, "after the abort"), "the scheduler never became idle"


@pytest.mark.all_seeds(core=("rust",), point=("k1", "n"))
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("core", TREE_CORES)
def test_abort_at_any_point_of_a_stream(tmp_path, core: str, point: str, sim_device) -> None:
    spec = _spec()
    seq = _context()
    _write(spec, tmp_path, core, seq)
    with _stack(spec, tmp_path, core) as st:
        assert idle_check.check(st, "a fresh stack")
        h = st.start_prefetch(seq, f"abort-{point}")
        lane = lane_of(st.cache.buffer_pipeline)
        _tick_until(st, lambda: _reached(st, h, point), f"{point} landed")
        s = lane.streams.get(h)
        assert s is not None and len(s.rows), "the stream holds its rows when aborted"
        _abort_and_drain(st, h)
        back_to_baseline(st)


@pytest.mark.parametrize("core", TREE_CORES)
def test_abort_while_parked_for_rows(tmp_path, core: str, sim_device) -> None:
    """A hit that waits, parked, for rows held by a running request (`waited_busy`) holds
    nothing of its own: its abort leaves the pools as they were, and once the other
    request is done the scheduler is idle with every pool at baseline."""
    spec = _spec()
    seq = _context()
    _write(spec, tmp_path, core, seq)
    with _stack(spec, tmp_path, core) as st:
        busy = st.allocator.alloc(st.allocator.available_size() - len(seq) // 2)
        assert busy is not None
        h = st.start_prefetch(seq, "parked")
        lane = lane_of(st.cache.buffer_pipeline)
        waited = metrics.get("l3_stream_restore", "waited_busy")
        _tick_until(st, lambda: metrics.get("l3_stream_restore", "waited_busy") > waited, "the hit to wait for rows")
        assert h not in lane.streams and st.cache.buffer_pipeline.pending_hit_allocs, "the hit must wait parked"
        st.cache.release_aborted_request(h)
        for _ in range(5):
            st.cache.check_hicache_events()
        assert not lane.streams and not lane.retiring
        st.allocator.free(busy)  # the running request finishes
        _tick_until(st, lambda: idle_check.fully_idle(st), "the scheduler to go idle")
        back_to_baseline(st)
