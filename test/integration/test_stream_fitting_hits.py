"""An L3 hit that fits the host staging buffer is streamed too (`stream-fitting-hits`,
issue 50 item 3), so its copies overlap its reads, instead of upstream's staged path
(read all into host, copy all at admission).

Real upstream stack on CPU (`L3Stack`), Mamba hybrid, buffer-only, our store. A writer
writes a context of ~5/6 of the reader's host buffer (longer than one piece, so at
least two rounds); a fresh reader (a restart) restores it: page sizes 1 and 64, both
tree cores; `l3_stream_restore{started}` and `{fitting}` +1, KV of every token, the
node's and the request's Mamba state bit-exact, every pool back at baseline.

When it stays upstream's: a device that cannot take the whole hit now (rows held by
others, not enough evictable) gets no stream, no wait and no cut, and restores exactly
through upstream's path once the rows are free; with rows held but enough evictable
ones, the stream starts (evicting them); `best_effort` gets no stream. Each of those
ends with a positive control on the same reader (the hit streams once the condition is
gone), so every test fails with the patch disabled; the negative control runs with the
patch undone (started +0, still exact). Share: a second request for the prefix a fitting
stream restores waits for it (patch stream-share) rather than streaming it again.
"""

from __future__ import annotations

import pytest
from sglang_l3 import metrics
from sglang_l3.patches.hicache.streamed_restore import lane_of, piece_size, piece_tokens
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack
from streamed_support import BUFFER, back_to_baseline, make_spec, pump, reader, write

STARTED = "l3_stream_restore{started}"
FITTING = "l3_stream_restore{fitting}"


def fitting_context(page_size: int, start: int = 11) -> list[int]:
    """~5/6 of the host pool (BUFFER + one page), whole pages: the "1.2" buffer."""
    n = (BUFFER + page_size) * 5 // 6 // page_size * page_size
    return list(range(start, start + n))


def delta(c0: dict) -> dict:
    c1 = metrics.snapshot()
    return {k: c1.get(k, 0) - c0.get(k, 0) for k in set(c1) | set(c0)}


def assert_fits_and_spans_pieces(st: L3Stack, seq: list[int]) -> None:
    pipe = st.cache.buffer_pipeline
    host = st.cache.cache_controller.mem_pool_host.size
    assert piece_tokens(pipe) < len(seq) <= host, (piece_tokens(pipe), len(seq), host)


def restore_streams(st: L3Stack, seq: list[int], want, rid: str) -> None:
    """Restore `seq` from L3 in `st`: one fitting stream, exact, pools back at baseline."""
    c0 = metrics.snapshot()
    st.scribble()
    req, loaded = st.restore(seq, rid)
    st.check_restored(seq, req, loaded, want, kv=True)
    d = delta(c0)
    assert d.get(STARTED) == 1 and d.get(FITTING) == 1, d
    assert d.get("l3_stream_restore{restored}") == 1, d
    # pieces of 1/FITTING_ROUNDS of the hit (piece_size), the last one through upstream's prefetch
    host, page = st.cache.cache_controller.mem_pool_host.size, st.cache.page_size
    pieces = -(-loaded // piece_size(host, page, loaded)) - 1
    assert d.get("l3_stream_restore_pieces", 0) == pieces >= 1, (d, pieces)
    assert d.get("l3_restores") == 1 and not d.get("fail_stops"), d
    back_to_baseline(st, req)


def spec_for(page_size: int) -> HybridSpec:
    return make_spec(page_size, len(fitting_context(page_size)))


@pytest.mark.all_seeds(page_size=(64,), core=("rust",))
@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("page_size", (1, 64))
def test_a_hit_that_fits_the_host_buffer_streams(tmp_path, page_size: int, core: str) -> None:
    spec = spec_for(page_size)
    seq = fitting_context(page_size)
    (want,) = write(spec, tmp_path, core, [seq])
    with reader(spec, tmp_path, core) as st:
        assert_fits_and_spans_pieces(st, seq)
        restore_streams(st, seq, want, "fits")


@pytest.mark.parametrize("evictable", [False, True], ids=["busy", "evictable"])
def test_rows_held_now_keep_upstreams_path_unless_evictable_rows_make_room(tmp_path, evictable: bool) -> None:
    """Rows held by other requests, a context resident and evictable: when free +
    evictable rows are a page short of the hit, it goes through upstream's staged path
    (no stream, no wait, no cut, nothing evicted), exact once the rows are free; when
    they take it whole, it streams (evicting the context)."""
    page = 64
    spec = spec_for(page)
    seq = fitting_context(page)
    other = list(range(50_000, 50_000 + 2 * page))  # resident on the reader's device, evictable
    (want,) = write(spec, tmp_path, "rust", [seq])
    with reader(spec, tmp_path, "rust") as st:
        assert_fits_and_spans_pieces(st, seq)
        st.write(other, marker=7.0)
        st.settle()
        assert st.match(other).device_prefix_len == len(other)
        # free + evictable rows: the whole hit, or one page short of it
        free = len(seq) - len(other) - (0 if evictable else page)
        hog = st.allocator.alloc(st.allocator.available_size() - free)
        assert hog is not None
        room = st.allocator.available_size() + st.cache.full_evictable_size()
        assert (room >= len(seq)) == evictable, (room, len(seq))
        c0 = metrics.snapshot()
        st.scribble()
        h, loaded = st.prefetch(seq, "held")
        assert loaded == len(seq) and st.cache.buffer_pipeline.has_staged(h)
        d = delta(c0)
        if evictable:
            assert d.get(STARTED) == 1 and d.get(FITTING) == 1, d
            assert st.match(other).device_prefix_len == 0, "the evictable context was not evicted"
        else:
            assert not d.get(STARTED) and not d.get(FITTING), d
            assert not any(
                k.startswith(("l3_stream_restore{waited", "l3_stream_restore{truncated")) and d[k] for k in d
            ), d
            assert not any(k.startswith("l3_stream_restore{declined") and d[k] for k in d), d
            assert st.match(other).device_prefix_len == len(other), "evicted for a hit the stream did not take"
        st.allocator.free(hog)  # the other requests finish
        req, loaded = st.admit(h, seq, "held")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)
        # positive control: with the rows free, the same hit streams
        restore_streams(st, seq, want, "free")


def test_best_effort_keeps_upstreams_path(tmp_path) -> None:
    """`best_effort` stops a stream at the first poll and recomputes: a hit that fits the
    host keeps upstream's staged path (its read is what best_effort takes)."""
    page = 64
    spec = spec_for(page)
    seq = fitting_context(page)
    (want,) = write(spec, tmp_path, "rust", [seq])
    with reader(spec, tmp_path, "rust") as st:
        assert_fits_and_spans_pieces(st, seq)
        cache = st.cache
        cache.prefetch_stop_policy = "best_effort"
        c0 = metrics.snapshot()
        h = st.start_prefetch(seq, "best-effort")

        def queued() -> bool:
            info = cache.ongoing_prefetch.get(h)
            return info is not None and info.operation.host_indices is not None

        pump(st, queued, "upstream to queue the hit's read")
        assert h not in lane_of(cache.buffer_pipeline).streams
        d = delta(c0)
        assert not d.get(STARTED) and not d.get(FITTING), d
        cache.prefetch_stop_policy = "wait_complete"  # let upstream's read finish: the pools come back
        pump(st, lambda: cache.check_prefetch_progress(h) and cache.buffer_pipeline.has_staged(h), "staged")
        assert cache.pop_prefetch_loaded_tokens(h) == len(seq)
        cache.buffer_pipeline.release_staged_hold(h)
        back_to_baseline(st)
        # positive control: under wait_complete the same hit streams
        restore_streams(st, seq, want, "wait-complete")


@pytest.mark.parametrize("without", ["stream-fitting-hits"], indirect=True)
def test_without_patch_the_hit_takes_upstreams_path(tmp_path, without) -> None:
    page = 64
    spec = spec_for(page)
    seq = fitting_context(page)
    (want,) = write(spec, tmp_path, "rust", [seq])
    with reader(spec, tmp_path, "rust") as st:
        assert_fits_and_spans_pieces(st, seq)
        c0 = metrics.snapshot()
        st.scribble()
        req, loaded = st.restore(seq, "upstream")
        st.check_restored(seq, req, loaded, want, kv=True)
        d = delta(c0)
        assert not d.get(STARTED) and not d.get(FITTING), d
        assert d.get("l3_restores") == 1, d
        back_to_baseline(st, req)


def test_a_second_request_for_a_fitting_prefix_shares_the_stream(tmp_path) -> None:
    """Patch stream-share treats a hit this patch takes as a stream's: B, wanting the
    prefix A is streaming, waits (`wait_shared`) instead of streaming the same pages into
    a second set of rows, then finds A's restore in the tree (nothing read for B)."""
    page = 64
    spec = spec_for(page)
    seq = fitting_context(page)
    (want,) = write(spec, tmp_path, "rust", [seq])
    with reader(spec, tmp_path, "rust") as st:
        cache = st.cache
        pipe = cache.buffer_pipeline
        c0 = metrics.snapshot()
        st.scribble()
        ha = st.start_prefetch(seq, "A")
        hb = st.start_prefetch(seq, "B")
        pump(st, lambda: cache.check_prefetch_progress(ha) and pipe.has_staged(ha), "A to stage")
        assert hb not in lane_of(pipe).streams and not pipe.has_staged(hb)
        d = delta(c0)
        assert d.get(STARTED) == 1 and d.get(FITTING) == 1, d
        assert d.get("l3_stream_restore{wait_shared}") == 1, d
        assert cache.pop_prefetch_loaded_tokens(ha) == len(seq)
        req, loaded = st.admit(ha, seq, "A")
        st.check_restored(seq, req, loaded, want, kv=True)
        pump(st, lambda: cache.check_prefetch_progress(hb), "B's hit to resolve")
        assert not pipe.has_staged(hb) and not cache.pop_prefetch_loaded_tokens(hb)
        assert delta(c0).get(STARTED) == 1, "B streamed the prefix again"
        back_to_baseline(st, req)
