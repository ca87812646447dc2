"""Device eviction while a streamed restore is in flight (`streamed-restore`, issue 11).

Real upstream stack on CPU (`L3Stack`), both tree cores, page 64, a context 8x the
host buffer. The reader holds the context's first turn on the device (the splice
base J) and an unrelated context; mid-stream (pieces landed in the private rows R,
more in flight) the device is put under pressure: everything evictable is evicted
and the freed rows are handed to someone else, who scribbles over them.

- J pinned (the default anchor cap): the unrelated context goes, J's KV stays
  (the full pin does not hold J's Mamba state, which the restore does not need:
  the state comes at the end P); the restore completes and the whole context — J from the device, R and the last
  piece from L3 — is bit-exact, Mamba slots included; pools back to baseline.
- J unpinned (anchor cap 0, upstream launches "unlocked"): J goes; the stream
  notices (upstream revokes the op on `anchor_lost`), frees R once and stages
  nothing; a later restore of the whole context from L3 is bit-exact. The same
  after the stream staged: admission finds the plan shrunk, the hold and R go.
- The prefetch stop policy applied to a stream's rounds.
"""

from __future__ import annotations

import time

import pytest
from sglang_l3 import metrics
from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack
from streamed_support import back_to_baseline, pump

PAGE = 64
BUFFER = 256
TURN1 = 512
CONTEXT = 8 * (BUFFER + PAGE)  # 2560 tokens, 8x the reader's host pool (320)


def spec() -> HybridSpec:
    return HybridSpec(page_size=PAGE, kv_size=6144, max_context_len=CONTEXT + 256)


def stack(tmp_path, core: str) -> L3Stack:
    s = spec()
    st = L3Stack(s, str(tmp_path), tree_core=core, server_args={"hicache_ratio": BUFFER / s.kv_size})
    cc = st.cache.cache_controller
    cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)
    return st


def pressure(st: L3Stack) -> None:
    """Evict everything evictable, hand the freed rows to another request, scribble
    over them, and give them back."""
    st.evict_all()
    free = st.allocator.available_size()
    other = st.allocator.alloc(free // PAGE * PAGE)
    assert other is not None
    layer = st.kv_pool.start_layer
    st.kv_pool.get_key_buffer(layer)[other] = -3
    st.kv_pool.get_value_buffer(layer)[other] = -3
    st.allocator.free(other)


@pytest.mark.all_seeds(core=("rust",))
@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("pinned", (True, False))
def test_eviction_mid_stream(tmp_path, monkeypatch, core: str, pinned: bool) -> None:
    seq = list(range(11, 11 + CONTEXT))
    other = list(range(70_000, 70_000 + 4 * PAGE))
    with stack(tmp_path, core) as w:
        w.write(seq[:TURN1], marker=3.0)
        want = w.write(seq, marker=4.0)
        w.settle()
    if not pinned:
        monkeypatch.setenv("SGLANG_HICACHE_BUFFER_ANCHOR_LOCK_CAP", "0")
    with stack(tmp_path, core) as st:
        pipe = st.cache.buffer_pipeline
        lane = lane_of(pipe)
        assert (pipe.anchor_lock_cap_tokens > 0) == pinned
        # The reader computed turn 1 itself (same KV and state as the writer's) and
        # holds an unrelated context; both are unlocked, evictable tree nodes.
        st.write(seq[:TURN1], marker=3.0, flush=False)
        st.write(other, marker=5.0, flush=False)
        st.flush_backups()
        h = st.start_prefetch(seq, "long")
        pump(st, lambda: h in lane.streams and lane.streams[h].landed_pages >= 1, "a landed piece")
        s = lane.streams[h]
        assert s.start == TURN1 and s.state == "reading" and s.next_page < len(s.keys)
        pressure(st)
        assert st.match(other).device_prefix_len == 0, "the unrelated context must be evicted"
        if pinned:
            # The pin keeps J's KV (its Mamba state may go: the restore brings the
            # state at P, not at J).
            assert st.match(seq[:TURN1]).full_kv_hit_length == TURN1, "the pinned base was evicted"
            pump(st, lambda: st.cache.check_prefetch_progress(h) and pipe.has_staged(h), "the stream to stage")
            assert st.cache.pop_prefetch_loaded_tokens(h) == CONTEXT - TURN1
            # R's pieces landed before the pressure are checked here too: had R been
            # freed, its rows would have been scribbled by `pressure`.
            req, loaded = st.admit(h, seq, "long")
            st.check_restored(seq, req, loaded, want, resident=TURN1, kv=True)
            back_to_baseline(st, req)
            return
        assert st.match(seq[:TURN1]).device_prefix_len == 0, "an unpinned base is evictable"
        aborted = metrics.get("l3_stream_restore", "aborted")
        pump(st, lambda: st.cache.check_prefetch_progress(h) and not lane.streams, "the stream to end")
        assert not pipe.has_staged(h), "a stream whose base was evicted must not stage"
        assert metrics.get("l3_stream_restore", "aborted") == aborted + 1
        st.cache.pop_prefetch_loaded_tokens(h)
        back_to_baseline(st)
        # The whole context still comes back from L3, bit-exact.
        st.scribble()
        req, loaded = st.restore(seq, "again")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)


@pytest.mark.all_seeds(core=("rust",), policy=("timeout",))
@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("policy", ("best_effort", "timeout", "wait_complete"))
def test_stop_policy_applies_to_the_stream(tmp_path, monkeypatch, core: str, policy: str) -> None:
    """`--hicache-storage-prefetch-policy` while rounds run (upstream's op is parked):
    best_effort stops the stream at the first admission poll; timeout at the first
    poll past upstream's budget (here 0 s); wait_complete waits. A stopped stream
    frees R once, stages nothing, and the request recomputes (pools at baseline)."""
    import sglang_l3.patches.hicache.streamed_restore as sr

    seq = list(range(11, 11 + CONTEXT))
    with stack(tmp_path, core) as w:
        want = w.write(seq, marker=4.0)
        w.settle()
    read = sr._read_piece

    def slow_read(cc, op, keys, host, prefix):
        time.sleep(0.02)  # keep the stream in its rounds while the request is polled
        return read(cc, op, keys, host, prefix)

    monkeypatch.setattr(sr, "_read_piece", slow_read)
    with stack(tmp_path, core) as st:
        cache, pipe = st.cache, st.cache.buffer_pipeline
        lane = lane_of(pipe)
        cache.prefetch_stop_policy = policy
        cache.prefetch_timeout_base = cache.prefetch_timeout_per_page = 0.0
        stopped = metrics.get("l3_stream_restore", f"stop_{policy}")
        st.scribble()
        h = st.start_prefetch(seq, "p")
        pump(st, lambda: h in lane.streams, "the stream to start")
        assert lane.streams[h].state == "reading"
        polls = [cache.check_prefetch_progress(h)]
        if policy == "timeout":
            assert polls == [False], "the first poll starts the budget"
            time.sleep(0.01)
            polls.append(cache.check_prefetch_progress(h))
        if policy == "wait_complete":
            assert polls == [False]
            pump(st, lambda: cache.check_prefetch_progress(h) and pipe.has_staged(h), "the stream to stage")
            assert cache.pop_prefetch_loaded_tokens(h) == CONTEXT
            req, loaded = st.admit(h, seq, "p")
            st.check_restored(seq, req, loaded, want, kv=True)
            back_to_baseline(st, req)
            return
        assert polls[-1] is True, "the policy must stop the stream"
        assert h not in cache.ongoing_prefetch and not pipe.has_staged(h)
        pump(st, lambda: not lane.streams, "the stopped stream to end")
        assert metrics.get("l3_stream_restore", f"stop_{policy}") == stopped + 1
        assert cache.pop_prefetch_loaded_tokens(h) == 0
        back_to_baseline(st)


@pytest.mark.all_seeds(core=("python",))
@pytest.mark.parametrize("core", TREE_CORES)
def test_unpinned_base_evicted_after_staging(tmp_path, monkeypatch, core: str) -> None:
    """The stream staged (R private, last piece in the host bounce), then J (unpinned,
    anchor cap 0) is evicted before admission: upstream's `prepare_staged_prefetch`
    finds the plan shrunk and releases the staged hold; R is freed with it, once,
    and nothing is spliced. A later restore of the whole context is bit-exact."""
    seq = list(range(11, 11 + CONTEXT))
    with stack(tmp_path, core) as w:
        w.write(seq[:TURN1], marker=3.0)
        want = w.write(seq, marker=4.0)
        w.settle()
    monkeypatch.setenv("SGLANG_HICACHE_BUFFER_ANCHOR_LOCK_CAP", "0")
    with stack(tmp_path, core) as st:
        pipe = st.cache.buffer_pipeline
        lane = lane_of(pipe)
        st.write(seq[:TURN1], marker=3.0, flush=False)
        st.flush_backups()
        h = st.start_prefetch(seq, "late")
        pump(st, lambda: st.cache.check_prefetch_progress(h) and pipe.has_staged(h), "the stream to stage")
        assert lane.streams[h].state == "staged" and lane.streams[h].start == TURN1
        assert st.cache.pop_prefetch_loaded_tokens(h) == CONTEXT - TURN1
        released = metrics.get("l3_stream_restore", "released_shrunk")
        pressure(st)
        assert st.match(seq[:TURN1]).full_kv_hit_length == 0, "an unpinned base is evictable"
        # Admission (as `L3Stack.admit`, before any slot is taken): the plan has
        # shrunk, the hold is released.
        req = st.new_req("late", seq)
        req.cache_request_handle = h
        m = st.match(seq)
        req.prefix_len, req.last_node = m.device_prefix_len, m.last_device_node
        assert not pipe.prepare_staged_prefetch(req), "a shrunk plan must not be admitted"
        assert not pipe.has_staged(h) and not lane.streams
        assert metrics.get("l3_stream_restore", "released_shrunk") == released + 1
        back_to_baseline(st)
        st.scribble()
        req, loaded = st.restore(seq, "again")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)


@pytest.mark.all_seeds(core=("rust",))
@pytest.mark.parametrize("core", TREE_CORES)
def test_a_stopped_stream_gives_its_device_rows_back_while_its_reads_hang(
    tmp_path, monkeypatch, core: str, sim_device
) -> None:
    """A store that stops answering (a hung disk) while a stream's pieces are read: the
    timeout policy stops the stream and the request recomputes, which needs device rows.
    The stream gives its rows R and its anchor pin back at the next tick, although its
    reads are still in flight (they fill host slots only, freed when they return);
    before, R stayed taken until the reads returned, and every request that needed
    those rows waited with it (a server's whole pool, for as long as the store hung).
    On the simulated asynchronous device the first piece's copy into R is kept unacked
    over the stop: R goes back only once that copy completed, never while it may still
    write."""
    import threading

    import sglang_l3.patches.hicache.streamed_restore as sr
    from sglang_l3.sim import streams as sim_streams

    seq = list(range(11, 11 + CONTEXT))
    with stack(tmp_path, core) as w:
        w.write(seq, marker=4.0)
        w.settle()
    read = sr._read_piece
    store_back = threading.Event()
    calls: list[int] = []
    hung: list[int] = []

    def hanging_read(cc, op, keys, host, prefix):
        calls.append(len(keys))
        if len(calls) > 1:  # the first piece is read; the store hangs after it
            hung.append(len(keys))
            assert store_back.wait(120), "the test never released the store"
        return read(cc, op, keys, host, prefix)

    monkeypatch.setattr(sr, "_read_piece", hanging_read)
    with stack(tmp_path, core) as st:
        cache, pipe = st.cache, st.cache.buffer_pipeline
        lane = lane_of(pipe)
        cache.prefetch_stop_policy = "timeout"
        cache.prefetch_timeout_base = cache.prefetch_timeout_per_page = 0.0
        free_before = st.allocator.available_size()
        held = sim_device is not None
        try:
            if held:
                sim_streams.hold_acks(True)  # the first piece's copy into R stays in flight
            h = st.start_prefetch(seq, "p")
            pump(
                st,
                lambda: h in lane.streams and bool(hung) and (not held or bool(lane.streams[h].copying)),
                "a read to hang" + (" beside a copy in flight" if held else ""),
            )
            s = lane.streams[h]
            assert len(s.rows) > 0 and s.pieces
            assert st.allocator.available_size() < free_before
            assert cache.check_prefetch_progress(h) is False, "the first poll starts the budget"
            time.sleep(0.01)
            assert cache.check_prefetch_progress(h) is True, "the timeout policy must stop the stream"
            cache.pop_prefetch_loaded_tokens(h)
            if held:
                pump(st, lambda: not len(s.rows), "the stopped stream to hand its rows to its copy")
                for _ in range(20):
                    st.cache.check_hicache_events()
                assert lane.retiring, "the copy in flight must keep the rows it writes"
                assert st.allocator.available_size() < free_before, "rows freed while a copy may write them"
                sim_streams.hold_acks(False)
            pump(
                st,
                lambda: st.allocator.available_size() == free_before,
                "the stopped stream to give its rows back",
                timeout=60,
            )
            # the reads still hang: the stream holds their host slots, nothing on the device
            assert h in lane.streams and s.state == "aborting" and s.pieces and s.pin is None and not len(s.rows)
            assert not pipe.is_idle(), "host slots are still held: the leak check must not run"
        finally:
            sim_streams.hold_acks(False)
            store_back.set()
        pump(st, lambda: not lane.streams, "the stopped stream to end once its reads returned")
        assert metrics.get("l3_stream_restore", "stop_timeout") >= 1
        back_to_baseline(st)
