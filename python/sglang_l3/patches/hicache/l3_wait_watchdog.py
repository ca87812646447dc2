"""Patch `l3-wait-watchdog` (why: patches/series.toml): a request that has waited on
L3 longer than its prefetch budget plus a margin is reported. Two modes:

- detect (the default): one log line naming the request, what it waits on (the
  stream, the parked hit, ...) and for how long, and counter `l3_wait_overdue`; once
  per request wait. Nothing else changes: no collective, no device sync, the request
  keeps waiting (each rank decides and logs alone; only the count is per rank).
- SGLANG_L3_VERIFY=1: the request is logged with every TP rank's view of it, then
  recomputed instead of waited on (below).

How, after each `Scheduler.get_next_batch_to_run` (a lockstep point):

- A queued request waits on L3 while its hit is in flight, parked, streaming (patch
  streamed-restore) or staged. Its clock advances only over passes in which the
  scheduler ran nothing (`batch_to_run` None): running work frees memory and moves
  the queue by itself, so only a wait that nothing will end is counted. A hang is such
  a wait; so is a store read that never completes on an idle server.
- The budget is upstream's prefetch budget for the request's hit
  (`prefetch_timeout_base` + pages x `prefetch_timeout_per_page`, the `timeout`
  policy's), for every policy; the margin is SGLANG_L3_WAIT_MARGIN seconds.
- On such a pass the over-budget flags are MAX-reduced across the TP ranks (wall
  clocks differ, the waiting list and the idle flag do not), so every rank abandons
  the same requests in the same pass. Each rank's state is all-gathered and logged
  (one line, "l3_wait_abandoned"), then the request's L3 state is released through
  upstream's own abort path (`release_aborted_request`: staged hold, parked or
  in-flight prefetch; a stream is aborted first), its wait marked expired (no
  re-issue), and it is admitted as a recompute. Counter `l3_wait_abandoned`, which
  must stay 0 (a test that reads it fails otherwise). An abandoned request is not
  abandoned (nor counted) again while it keeps waiting: its aborted stream stays in
  state `aborting` until the copies already queued into its rows are acked.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from sglang_l3 import envs, metrics
from sglang_l3.patches.framework import PatchContext
from sglang_l3.patches.hicache.streamed_restore import abort_stream, lane_of

logger = logging.getLogger("sglang_l3.l3_wait_watchdog")

SCHED = "sglang.srt.managers.scheduler:Scheduler"
MARGIN_ENV = "SGLANG_L3_WAIT_MARGIN"
MARK = "l3_wait_abandoned"  # the counter, and the word every abandon log line carries
OVERDUE = "l3_wait_overdue"  # detect mode's counter, and the word its log line carries


def verify_mode() -> bool:
    """SGLANG_L3_VERIFY=1: abandon (collectives); else detect and log only."""
    return envs.flag("SGLANG_L3_VERIFY")


@dataclasses.dataclass
class _Clock:
    since: float  # first pass it was seen waiting (monotonic)
    stalled: float = 0.0  # seconds of idle passes since
    reported: bool = False  # detect mode: logged and counted once
    # verify mode: abandoned once; its aborted stream may stay `aborting` (and the request
    # queued on it) until the copies into R are acked: not abandoned again meanwhile
    abandoned: bool = False


@dataclasses.dataclass
class _Watch:
    clocks: dict[Any, _Clock] = dataclasses.field(default_factory=dict)
    last: float | None = None


def waiting_on_l3(cache: Any, req: Any) -> str | None:
    """What `req` waits on in L3 (None: nothing)."""
    h = getattr(req, "cache_request_handle", None)
    pipe = getattr(cache, "buffer_pipeline", None)
    if h is None or pipe is None:
        return None
    s = lane_of(pipe).streams.get(h)
    if s is not None:
        return f"stream {s.state} landed={s.landed_pages}/{len(s.keys)} rows={len(s.rows)}"
    info = cache.ongoing_prefetch.get(h)
    if info is not None:
        op = info.operation
        if any(p is op for p in pipe.pending_hit_allocs):
            return f"hit parked ({op.storage_hit_count} tokens)"
        return "store read" if info.host_indices is not None else "hit query"
    if pipe.has_staged(h):
        return "staged, awaiting admission"
    return None


def budget_s(cache: Any, req: Any) -> float:
    """Upstream's prefetch budget for the request's hit (the `timeout` policy's)."""
    h = req.cache_request_handle
    tokens = 0
    info = cache.ongoing_prefetch.get(h)
    pipe = cache.buffer_pipeline
    s = lane_of(pipe).streams.get(h)
    if info is not None:
        tokens = int(getattr(info.operation, "stats_requested_tokens", 0) or info.operation.storage_hit_count)
    elif s is not None:
        tokens = s.hit
    elif h in pipe.staged_prefetches:
        tokens = int(pipe.staged_prefetches[h].num_tokens)
    pages = tokens // max(1, cache.page_size)
    return float(cache.prefetch_timeout_base) + pages * float(cache.prefetch_timeout_per_page)


def _group(sched: Any) -> Any:
    return getattr(sched, "dp_tp_cpu_group", None)


def _gather(sched: Any, mine: list[str]) -> list[list[str]]:
    import torch.distributed as dist

    group = _group(sched)
    if group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [mine]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


def check(sched: Any, idle: bool, now: float | None = None, verify: bool | None = None) -> list[str]:
    """One pass of the watchdog. Verify mode (`verify`, default `verify_mode()`): returns
    the request ids abandoned (same on every rank); detect mode: the ids reported now."""
    cache = sched.tree_cache
    if getattr(cache, "buffer_pipeline", None) is None:
        return []
    watch: _Watch = sched.__dict__.setdefault("_l3_wait_watch", _Watch())
    now = time.monotonic() if now is None else now
    dt = 0.0 if watch.last is None else now - watch.last
    watch.last = now
    waiting = [(req, st) for req in sched.waiting_queue if (st := waiting_on_l3(cache, req)) is not None]
    clocks: dict[Any, _Clock] = {}
    for req, _ in waiting:
        c = watch.clocks.get(req.cache_request_handle) or _Clock(now)
        if idle:
            c.stalled += dt
        clocks[req.cache_request_handle] = c
    watch.clocks = clocks
    if not waiting or not idle:
        return []
    margin = float(envs.value(MARGIN_ENV))
    limits = [budget_s(cache, req) + margin for req, _ in waiting]
    if not (verify_mode() if verify is None else verify):
        return _report(waiting, limits, clocks, now)
    over = [
        int(not (c := clocks[req.cache_request_handle]).abandoned and c.stalled > lim)
        for (req, _), lim in zip(waiting, limits, strict=True)
    ]
    t = torch.tensor(over, dtype=torch.int32)
    cache._all_reduce(t, torch.distributed.ReduceOp.MAX)  # any rank over: every rank abandons
    agreed = t.tolist()
    if not any(agreed):
        return []
    pick = [(req, st, lim) for (req, st), lim, f in zip(waiting, limits, agreed, strict=True) if f]
    mine = [_describe(sched, cache, req, st, clocks[req.cache_request_handle]) for req, st, _ in pick]
    everyone = _gather(sched, mine)
    out = []
    for i, (req, _, lim) in enumerate(pick):
        views = "; ".join(f"TP rank {r}: {states[i]}" for r, states in enumerate(everyone))
        logger.error(
            "sglang-l3 watchdog: %s req=%s waited on L3 longer than its budget + margin (%.1f s) while the "
            "scheduler was idle; it recomputes. %s",
            MARK,
            req.rid,
            lim,
            views,
        )
        _abandon(cache, req)
        clocks[req.cache_request_handle].abandoned = True
        out.append(str(req.rid))
    return out


def _report(waiting: list[tuple[Any, str]], limits: list[float], clocks: dict[Any, _Clock], now: float) -> list[str]:
    """Detect mode: log and count each request past budget + margin, once per wait."""
    out = []
    for (req, state), lim in zip(waiting, limits, strict=True):
        c = clocks[req.cache_request_handle]
        if c.reported or c.stalled <= lim:
            continue
        c.reported = True
        logger.warning(
            "sglang-l3 watchdog: %s req=%s waits on L3: %s; idle-waited %.1f s (budget + margin %.1f s, "
            "queued %.1f s); still waiting (SGLANG_L3_VERIFY=1 would recompute it)",
            OVERDUE,
            req.rid,
            state,
            c.stalled,
            lim,
            now - c.since,
        )
        metrics.inc(OVERDUE)
        out.append(str(req.rid))
    return out


def _describe(sched: Any, cache: Any, req: Any, state: str, clock: _Clock) -> str:
    pipe = cache.buffer_pipeline
    streams = ", ".join(f"{s.handle.rid}:{s.state}/{len(s.rows)}" for s in lane_of(pipe).streams.values())
    queue = [str(r.rid) for r in sched.waiting_queue]
    return (
        f"{state}, idle-waited {clock.stalled:.1f} s (queued {time.monotonic() - clock.since:.1f} s); "
        f"streams [{streams}]; parked hits {len(pipe.pending_hit_allocs)}; staged {len(pipe.staged_prefetches)}; "
        f"device free {cache.token_to_kv_pool_allocator.available_size()}; waiting queue {queue}"
    )


def _abandon(cache: Any, req: Any) -> None:
    from sglang.srt.mem_cache.unified_radix_cache import _StoragePrefetchWait

    pipe = cache.buffer_pipeline
    h = req.cache_request_handle
    s = lane_of(pipe).streams.get(h)
    if s is not None and s.state in ("reading", "ready", "final"):
        abort_stream(pipe, s, "abandoned")  # the tick frees R and the pin once the reads are back
    cache.release_aborted_request(h)  # staged hold / parked or in-flight prefetch, retries
    req.staged_prefetch_plan = None
    cache._storage_prefetch_wait.setdefault(h, _StoragePrefetchWait()).expired = True  # no re-issue
    metrics.inc(MARK)


def apply(ctx: PatchContext) -> None:
    def get_next_batch_to_run(orig: Any, sched: Any, *args: Any, **kwargs: Any) -> Any:
        plan = orig(sched, *args, **kwargs)
        if getattr(sched, "enable_hicache_storage", False):
            check(sched, idle=plan.batch_to_run is None)
        return plan

    ctx.around(f"{SCHED}.get_next_batch_to_run", get_next_batch_to_run)
