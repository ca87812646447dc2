"""Issue 24: two or three requests for one long L3 prefix, the later ones arriving
while the first one's streamed restore is in flight, on a device pool too short for
two copies of the prefix (`l3_stream_restore{truncated_device}` before the fix; since
a hit the pool could hold waits for rows instead of being cut, the tests of what follows
a cut turn that wait off).

Real upstream stack on CPU (`L3Stack`) and the real admission path
(`SchedulerHarness`), the server's sizes: page 64, device pool 4096, host buffer
384 tokens, a 2176-token prefix in L3 only (checkpoints at 1792 and 2176), requests of
2374 / 2394 / 2414 tokens. Every request must be answered within a bounded number of
scheduler passes, share the prefix the first one restores, and hold the right KV.
"""

from __future__ import annotations

import time

import pytest
from sglang_l3 import metrics
from sglang_l3.patches import framework
from sglang_l3.patches.hicache import streamed_restore as sr
from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack, wait_for_work

PAGE = 64
POOL = 4096
PREFIX = 2176
HOST_RATIO = 384 / POOL
MAX_PASSES = 600  # a pass restores a piece or computes a chunk; a few hundred is plenty


def _write_prefixes(tmp_path, core: str, seqs: list[list[int]]) -> None:
    spec = HybridSpec(page_size=PAGE, kv_size=8192, max_context_len=4096)
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args={"hicache_ratio": 0.25}) as w:
        for seq in seqs:
            w.write(seq[:1792], marker=3.0)
            w.write(seq[:PREFIX], marker=4.0)
        w.settle()
        assert not w.cache.buffer_pipeline.inflight_backup_pools


def drive(h, reqs: list, passes: int = MAX_PASSES, after_pass=None) -> dict:
    """Scheduler loop stand-in: events, retries, admission, a forward, finish
    (`after_pass(idle)` runs after each admission, where the watchdog hooks in).
    Returns {rid: (prefix_len at admission, KV rows matched what a model writes)}."""
    st = h.stack
    out: dict = {}
    t0 = time.monotonic()
    for _ in range(passes):
        h.s._process_hicache_events()
        h.stash_chunk()
        batch = h.admit()
        if after_pass is not None:
            after_pass(batch is None)
        if batch is not None:
            for r in batch.reqs:
                out.setdefault(r.rid, r.prefix_len)
            h.forward(batch)
            for r in batch.reqs:
                if r is not h.s.chunked_req:
                    n = len(r.origin_input_ids)
                    rows = st.req_to_token_pool.req_to_token[r.kv.req_pool_idx, :n].long()
                    k, v = st.expected_kv(list(r.origin_input_ids))
                    layer = st.kv_pool.start_layer
                    ok = st.kv_pool.get_key_buffer(layer)[rows].equal(k)
                    ok = ok and st.kv_pool.get_value_buffer(layer)[rows].equal(v)
                    out[r.rid] = (out[r.rid], ok)
                    h.finish(r)
        if all(isinstance(out.get(r.rid), tuple) for r in reqs):
            return out
        wait_for_work(st.cache)
    pipe = st.cache.buffer_pipeline
    raise AssertionError(
        f"not every request was admitted within {passes} passes (hang): done={out}, "
        f"waiting={[r.rid for r in h.s.waiting_queue]}, streams="
        f"{[(s.handle.rid, s.state, len(s.rows)) for s in lane_of(pipe).streams.values()]}, "
        f"staged={[k.rid for k in pipe.staged_prefetches]}, free={st.allocator.available_size()}; "
        # where each stream stood (reads in flight and whether done, pages launched and
        # landed, copies not yet complete), host slots free, and how long the passes took
        f"pieces={_stream_pieces(pipe)}, host_free={st.cache.cache_controller.mem_pool_host.available_size()}, "
        f"retiring={len(lane_of(pipe).retiring)}, {time.monotonic() - t0:.1f} s"
    )


def _stream_pieces(pipe) -> list:
    return [
        (
            s.handle.rid,
            [(pc.first_page, pc.pages, pc.future.done()) for pc in s.pieces],
            s.next_page,
            s.landed_pages,
            len(s.keys),
            len(s.copying),
        )
        for s in lane_of(pipe).streams.values()
    ]


def _burst(tmp_path, core: str, n: int, shared: bool, after_pass=None, passes: int = MAX_PASSES) -> tuple[dict, dict]:
    """X1 arrives, its stream starts, X2..Xn arrive; every request served. Returns
    ({rid: (prefix at admission, KV right)}, counter deltas)."""
    from sglang_l3.testing.scheduler_harness import SchedulerHarness

    seqs = [list(range(5, 5 + PREFIX)), list(range(20_000, 20_000 + PREFIX))]
    _write_prefixes(tmp_path, core, seqs if not shared else seqs[:1])
    spec = HybridSpec(page_size=PAGE, kv_size=POOL, max_context_len=4096)
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args={"hicache_ratio": HOST_RATIO}) as st:
        cc = st.cache.cache_controller
        cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)
        assert 4 * cc.mem_pool_host.size < PREFIX
        st.scribble()
        h = SchedulerHarness(st, chunked_prefill_size=256)
        pipe = st.cache.buffer_pipeline
        c0 = metrics.snapshot()
        reqs = [
            h.make_req(seqs[i % 2 if not shared else 0] + list(range(7000 + 100 * i, 7198 + 120 * i)), f"X{i + 1}", 8)
            for i in range(n)
        ]
        h.arrive(reqs[0])
        h.pump(lambda: reqs[0].cache_request_handle in lane_of(pipe).streams, "X1's stream to start")
        for r in reqs[1:]:
            h.arrive(r)
        got = drive(h, reqs, passes, None if after_pass is None else lambda idle: after_pass(h, idle))
        c1 = metrics.snapshot()
        delta = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1 if c1.get(k, 0) != c0.get(k, 0)}
        for r in reqs:
            assert got[r.rid][1], f"{r.rid}: KV differs from what the model would compute"
        st.settle()
        st.evict_all()
        st.settle()
        assert not lane_of(pipe).streams
        assert cc.prefetch_tokens_occupied == 0
        st.cache.sanity_check()
        assert st.pool_sizes() == st.baseline, "a pool did not return to its baseline"
    return got, delta


# The fallback for a hit larger than the whole device pool: cut it to what the pool
# has left now. These requests fit the pool, so a hit waits for rows instead; the
# tests of what follows a cut (a second stream holding rows the head needs) turn the
# wait off to get there.
def _cut_instead_of_waiting(monkeypatch) -> None:
    monkeypatch.setattr(sr, "waits_for_rows", lambda cache, hit_tokens: False)


@pytest.mark.all_seeds(core=("rust",), n=(2,))
@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("shared", (True, False), ids=("one-prefix", "two-prefixes"))
def test_burst_is_served(tmp_path, core: str, n: int, shared: bool) -> None:
    """One prefix: X1 restores it (one stream, never truncated), X2/X3 wait for it and
    share it from the tree. Two prefixes (X1, X3 on A, X2 on B): the pool has no room for
    B beside X1's stream, so X2's hit waits, parked and holding nothing, until X1's rows
    go, then restores B whole; nothing is cut."""
    got, delta = _burst(tmp_path, core, n, shared)
    assert got["X1"][0] == PREFIX, got
    assert not delta.get("l3_wait_abandoned"), delta
    assert not delta.get("l3_stream_restore{truncated_device}"), delta
    if shared:
        assert all(got[f"X{i + 1}"][0] == PREFIX for i in range(n)), got
        assert delta.get("l3_stream_restore{restored}") == 1, delta
        assert delta.get("l3_stream_restore{started}") == 1, delta
        assert delta.get("l3_stream_restore{wait_shared}") == 1, delta
    else:
        assert got["X2"][0] == PREFIX, got
        assert delta.get("l3_stream_restore{waited_busy}", 0) >= 1, delta
        assert delta.get("l3_stream_restore{restored}") == delta.get("l3_stream_restore{started}"), delta


def _cut_until_a_yield(monkeypatch) -> None:
    """Hits are cut instead of waiting until a stream has yielded; then upstream's
    default again (a hit the pool could hold waits for rows)."""
    waits = sr.waits_for_rows
    before = metrics.snapshot().get("l3_stream_yield", 0)

    def cut_first(cache, hit_tokens: int) -> bool:
        return metrics.snapshot().get("l3_stream_yield", 0) > before and waits(cache, hit_tokens)

    monkeypatch.setattr(sr, "waits_for_rows", cut_first)


@pytest.mark.all_seeds(n=(2,))
@pytest.mark.parametrize("core", TREE_CORES)
@pytest.mark.parametrize("n", (2, 3))
def test_a_cut_stream_yields_its_rows_and_restores_later(tmp_path, monkeypatch, core: str, n: int) -> None:
    """Two prefixes, hits cut until a stream yields: X2's stream of B is cut to what the
    pool has left beside X1's and yields its rows when X1 cannot be admitted; X2 then asks
    L3 again (patch stream-share's re-issue) and, once X1's rows are free, restores B
    whole. Before the re-issue X2 was admitted on what the device held of B, nothing,
    and recomputed all 2,176 tokens of it."""
    _cut_until_a_yield(monkeypatch)
    got, delta = _burst(tmp_path, core, n, False)
    assert got["X1"][0] == PREFIX, got
    assert delta.get("l3_stream_restore{truncated_device}"), delta
    # with three requests X2's second stream may yield to X3 too (each yield re-asks L3;
    # upstream's re-issue cap bounds them)
    assert delta.get("l3_stream_yield", 0) >= 1, delta
    assert delta.get("l3_stream_restore{refetch_yielded}") == delta["l3_stream_yield"], delta
    assert got["X2"][0] == PREFIX, f"X2 after its stream yielded: {got}, {delta}"
    assert delta.get("l3_stream_restore{restored}") == 2, delta
    assert not delta.get("l3_wait_abandoned"), delta


@pytest.mark.parametrize("shared", (True, False), ids=("one-prefix", "two-prefixes"))
def test_without_the_fix_the_burst_hangs(tmp_path, monkeypatch, shared: bool) -> None:
    """Negative control: with stream-share undone (one prefix) or its yield disabled
    (two prefixes), and hits cut instead of waiting, X1 waits at the head of the queue
    for rows X2's staged stream holds."""
    import sglang_l3.patches.hicache.stream_share as ss

    _cut_instead_of_waiting(monkeypatch)
    if shared:
        framework.undo("stream-share")
    else:
        monkeypatch.setattr(ss, "yield_rows", lambda pipe, head: 0)
    try:
        with pytest.raises(AssertionError, match="hang"):
            _burst(tmp_path, "rust", 2, shared, passes=200)
    finally:
        if shared:
            framework.apply_one(next(s for s in framework.load_series() if s.id == "stream-share"))
    assert framework.is_applied("stream-share")


HUNG_TICK_S = 0.1  # the watchdog's clock advances this much per pass of the hang, only


class _HangClock:
    """The watchdog's clock in these tests: time passes only on idle passes in which
    nothing is in flight (every request waits on a staged stream or on nothing), so who
    goes over budget + margin, and when, does not depend on how fast the box runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def tick(self, h, idle: bool) -> float:
        from sglang_l3.patches.hicache import l3_wait_watchdog as wd

        cache = h.stack.cache
        states = [wd.waiting_on_l3(cache, r) for r in h.s.waiting_queue]
        if idle and all(st is None or "staged" in st for st in states):
            self.now += HUNG_TICK_S
        return self.now


@pytest.mark.l3_wait_abandoned_expected
def test_watchdog_ends_the_hang(tmp_path, monkeypatch) -> None:
    """The watchdog (SGLANG_L3_VERIFY=1 in a server; called directly here) with the fix
    undone (and hits cut instead of waiting): X2 waits on L3 (its staged stream) past budget + margin on an idle
    scheduler; it is abandoned, its rows come back, X1 and then X2 are computed right.
    Under some seeds X1 is staged too when the hang starts (its hold not yet dropped):
    then it waits on L3 as long as X2 and is abandoned in the same pass. Either way
    each request is abandoned, and counted, at most once."""
    from sglang_l3.patches.hicache import l3_wait_watchdog as wd

    monkeypatch.setenv(wd.MARGIN_ENV, "0.5")
    _cut_instead_of_waiting(monkeypatch)
    abandoned: list = []
    clock = _HangClock()

    def watch(h, idle: bool) -> None:
        h.stack.cache.prefetch_timeout_base = 0.0
        h.stack.cache.prefetch_timeout_per_page = 0.0
        abandoned.extend(wd.check(h.s, idle, now=clock.tick(h, idle), verify=True))

    framework.undo("stream-share")
    try:
        got, delta = _burst(tmp_path, "rust", 2, True, after_pass=watch, passes=5000)
    finally:
        framework.apply_one(next(s for s in framework.load_series() if s.id == "stream-share"))
    assert abandoned in (["X2"], ["X1", "X2"]), abandoned
    assert delta.get("l3_wait_abandoned") == len(abandoned), delta
    assert got["X1"][0] == 0 and got["X2"][0] in (0, PREFIX), got  # X1 recomputed (its hold was dropped)


HELD_PASSES = 20  # idle passes the abandoned stream stays `aborting` with its acks held


@pytest.mark.sim_only
@pytest.mark.l3_wait_abandoned_expected
def test_watchdog_abandons_once_while_the_stream_aborts(tmp_path, monkeypatch) -> None:
    """Issue 33 (seen under seed 7): the watchdog (verify mode) abandons X1 while copies
    into its stream's rows are in flight. With their acks held, the stream stays
    `aborting` and X1 stays queued (its rows are not back) over many idle passes, each
    past budget + margin: X1 is abandoned, and counted, once. Released, the stream ends,
    X1 recomputes right and every pool is back to its baseline (checked by `_burst`)."""
    from sglang_l3.patches.hicache import l3_wait_watchdog as wd
    from sglang_l3.sim import streams as sim_streams

    monkeypatch.setenv(wd.MARGIN_ENV, "0.5")
    abandoned: list = []
    seen = {"clock": 0.0, "held": 0, "released": False}

    def watch(h, idle: bool) -> None:
        cache = h.stack.cache
        cache.prefetch_timeout_base = 0.0
        cache.prefetch_timeout_per_page = 0.0
        streams = list(lane_of(cache.buffer_pipeline).streams.values())
        s = streams[0] if streams else None
        if not abandoned and s is not None and s.state in ("reading", "ready", "final") and s.copying:
            sim_streams.hold_acks(True)  # the copies into R stay unacked from here on
            seen["clock"] += 1000.0  # and X1's wait leaps past any budget
        elif abandoned and not seen["released"]:
            # the copies stay in flight with the aborted stream, or with the lane once the
            # stream gave its rows to them and ended (its reads were done)
            if idle and (s is not None and s.state == "aborting" or lane_of(cache.buffer_pipeline).retiring):
                seen["held"] += 1
                seen["clock"] += 1000.0
            if seen["held"] >= HELD_PASSES:
                sim_streams.hold_acks(False)
                seen["released"] = True
        abandoned.extend(wd.check(h.s, idle, now=seen["clock"], verify=True))

    try:
        got, delta = _burst(tmp_path, "rust", 1, True, after_pass=watch, passes=5000)
    finally:
        sim_streams.hold_acks(False)
    assert seen["held"] == HELD_PASSES, seen  # the copies into R stayed in flight, X1 queued on them
    assert abandoned == ["X1"], abandoned
    assert delta.get("l3_wait_abandoned") == 1, delta
    assert got["X1"][0] == 0, got  # recomputed


class _Reported(Exception):
    pass


@pytest.mark.l3_wait_abandoned_expected
def test_watchdog_detect_mode_logs_and_changes_nothing(tmp_path, monkeypatch, caplog) -> None:
    """The watchdog's default mode (no SGLANG_L3_VERIFY) with the fix undone (and hits
    cut instead of waiting): once X2
    has idle-waited past budget + margin, one warning names X2, its stream and how long,
    and `l3_wait_overdue` rises by 1; no collective runs, nothing is released, X2 stays
    queued on its stream, and later passes do not report it again. (X1, when staged in
    the hang as well - some seeds - is reported alike, in the same pass, once.)"""
    import logging

    from sglang_l3.patches.hicache import l3_wait_watchdog as wd

    monkeypatch.setenv(wd.MARGIN_ENV, "0.5")
    monkeypatch.delenv("SGLANG_L3_VERIFY", raising=False)
    _cut_instead_of_waiting(monkeypatch)
    assert not wd.verify_mode()
    reported: list = []
    seen: dict = {}
    clock = _HangClock()

    def no_collective(*a, **k):
        raise AssertionError("detect mode ran a collective")

    def watch(h, idle: bool) -> None:
        cache = h.stack.cache
        cache.prefetch_timeout_base = 0.0
        cache.prefetch_timeout_per_page = 0.0
        with monkeypatch.context() as m:
            m.setattr(cache, "_all_reduce", no_collective)
            now = wd.check(h.s, idle, now=clock.tick(h, idle))
        reported.extend(now)
        if "X2" in reported and "after" not in seen:
            x2 = next(r for r in h.s.waiting_queue if r.rid == "X2")
            seen["stream"] = wd.waiting_on_l3(cache, x2)
            seen["after"] = 0
        elif "after" in seen:
            seen["after"] += 1
            if seen["after"] >= 20:  # more idle passes: reported once per wait
                raise _Reported

    before = metrics.get(wd.OVERDUE), metrics.get(wd.MARK)
    framework.undo("stream-share")
    try:
        with caplog.at_level(logging.WARNING, logger="sglang_l3.l3_wait_watchdog"), pytest.raises(_Reported):
            _burst(tmp_path, "rust", 2, True, after_pass=watch, passes=100_000)
    finally:
        framework.apply_one(next(s for s in framework.load_series() if s.id == "stream-share"))
    assert reported in (["X2"], ["X1", "X2"]), reported
    assert (seen["stream"] or "").startswith("stream "), seen  # still waiting on its stream
    assert metrics.get(wd.OVERDUE) - before[0] == len(reported) and metrics.get(wd.MARK) == before[1]
    lines = [r.getMessage() for r in caplog.records if wd.OVERDUE in r.getMessage()]
    assert len(lines) == len(reported), lines
    x2 = [ln for ln in lines if "req=X2" in ln]
    assert len(x2) == 1 and "stream " in x2[0] and "idle-waited" in x2[0], lines


@pytest.mark.parametrize("core", TREE_CORES)
def test_a_stream_leaves_a_chunked_prefill_its_rows(tmp_path, core: str) -> None:
    """A 3,000-token prompt is prefilled in 256-token chunks when Y arrives with the
    2,176-token prefix in L3 (pool 4096). Y's stream may not take the rows the chunked
    prefill has yet to allocate (admission counted them when it admitted the long
    prompt): it waits for rows, then restores its prefix whole. Before, the stream took
    them and the next chunk stopped the scheduler on `Prefill out of memory`."""
    from sglang_l3.testing.scheduler_harness import SchedulerHarness

    seq = list(range(5, 5 + PREFIX))
    _write_prefixes(tmp_path, core, [seq])
    spec = HybridSpec(page_size=PAGE, kv_size=POOL, max_context_len=4096)
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args={"hicache_ratio": HOST_RATIO}) as st:
        st.scribble()
        h = SchedulerHarness(st, chunked_prefill_size=256)
        long = h.make_req(list(range(30_000, 33_000)), "LONG", 8)
        y = h.make_req(seq + list(range(7000, 7100)), "Y", 8)
        h.arrive(long)
        batch = None
        for _ in range(MAX_PASSES):  # its L3 lookup (a miss) first
            h.s._process_hicache_events()
            batch = h.admit()
            if batch is not None:
                break
            wait_for_work(st.cache)
        assert batch is not None, "the long prompt's first chunk"
        h.forward(batch)
        assert h.s.chunked_req is long, "the long prompt is prefilled in chunks"
        c0 = metrics.snapshot()
        h.arrive(y)
        got = drive(h, [long, y])
        c1 = metrics.snapshot()
        delta = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1 if c1.get(k, 0) != c0.get(k, 0)}
        assert got["LONG"][1] and got["Y"][1], f"KV differs from what the model would compute: {got}"
        assert got["Y"][0] == PREFIX, (got, delta)
        assert delta.get("l3_stream_restore{waited_busy}") == 1, delta
        assert delta.get("l3_stream_restore{restored}") == 1, delta
        st.settle()
        st.evict_all()
        st.settle()
        assert not lane_of(st.cache.buffer_pipeline).streams
        st.cache.sanity_check()
        assert st.pool_sizes() == st.baseline, "a pool did not return to its baseline"
