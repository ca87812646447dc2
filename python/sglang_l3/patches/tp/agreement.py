"""Patches `tp-agreed-sidecar-heal`, `tp-agreed-flush`, `tp-verify-restores`
(why: patches/series.toml): every L3 decision that must be identical on every
TP rank is made from rank-agreed data, and SGLANG_L3_VERIFY=1 checks it at run
time.

How:

- tp-agreed-sidecar-heal: AROUND UnifiedRadixCache._check_hybrid_prefetch_result:
  when the agreed (MIN-reduced) completion is short (and no deadline expired),
  the non-KV transfers' keys are hidden for the call, so no rank heals a
  sidecar belief from a transfer some rank never ran. KV beliefs still heal
  from the agreed count; the discard is unchanged. A Mamba page believed
  stored but gone is healed by the next (MIN-reduced) exists query.
- tp-agreed-flush: AROUND Scheduler.flush_cache and SchedulerFlushWrapper:
  the idle flag is MIN-reduced and the deferred deadline MAX-reduced over the
  TP CPU group, so every rank flushes or refuses together. Every flush (any TP
  size) logs one line: done or refused, and the L3 pipeline's work and
  `l3_write_dropped` as they were when it was asked (`flush_state`).
- tp-verify-restores (SGLANG_L3_VERIFY=1 only): every restore decision
  (request id, restored tokens, node path length) is recorded at
  BufferModePipeline.init_load_back and all-gathered over the TP CPU group right
  after the scheduler chose its batch, before any forward pass; a difference is
  a fail-stop that prints every rank's records.

All three read or reduce only in the scheduler thread, where the TP ranks run
in lockstep (one control request or one loop iteration on every rank).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.tp_agreement")

URC = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
SCHED = "sglang.srt.managers.scheduler:Scheduler"
FLUSH = "sglang.srt.managers.scheduler_components.flush_wrapper:SchedulerFlushWrapper"
PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"

# Test-only fault (sglang_l3.faults): "restore-fallback@<rank>" makes that TP
# rank alone fall back to recompute on its first L3 restore, to show that
# SGLANG_L3_VERIFY=1 catches a rank disagreement before a forward pass.


class RankDisagreement(RuntimeError):
    """TP ranks made different restore decisions: fail-stop."""


def verify_enabled() -> bool:
    return os.environ.get("SGLANG_L3_VERIFY", "0").lower() in ("1", "true", "yes")


def _world(group: Any) -> int:
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if _world(group) > 1 else 0


def agree(group: Any, flag: bool, *, all_ranks: bool = True) -> bool:
    """all_ranks: True iff the flag holds on every rank (MIN); else on any (MAX)."""
    if _world(group) == 1:
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if all_ranks else dist.ReduceOp.MAX, group=group)
    return bool(t.item())


# --------------------------------------------------------------------------- #
# tp-agreed-sidecar-heal
# --------------------------------------------------------------------------- #
def _check_hybrid_prefetch_result(
    original: Callable,
    cache: Any,
    request: Any,
    operation: Any,
    hash_value: Any,
    host_indices: Any,
) -> Any:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    hidden: list[tuple[Any, Any]] = []
    # completed_tokens is MIN-reduced and deadline_expired agreed: the same on every rank.
    short = operation.completed_tokens < len(hash_value) * cache.page_size
    if short and not operation.deadline_expired:
        for t in operation.pool_transfers or ():
            if t.indices_from_pool != PoolName.KV and t.keys is not None:
                hidden.append((t, t.keys))
    for t, _ in hidden:
        t.keys = None
    if hidden:
        metrics.inc("tp_sidecar_heal_skipped")
    try:
        return original(cache, request, operation, hash_value, host_indices)
    finally:
        for t, keys in hidden:
            t.keys = keys


# --------------------------------------------------------------------------- #
# tp-agreed-flush
# --------------------------------------------------------------------------- #
def _flush_group(sched: Any) -> Any:
    return getattr(sched, "dp_tp_cpu_group", None)


# What BufferModePipeline.is_idle requires to be empty (the flush resets only when it is).
_PIPE_WORK = (
    "pending_write_queue",
    "inflight_backup_node_ids",
    "ongoing_write_through",
    "ongoing_backup",
    "staged_prefetches",
    "pending_hit_allocs",
    "ongoing_buffer_load_back",
    "anchor_locks",
)


def flush_state(sched: Any) -> str | None:
    """The L3 pipeline at a /flush_cache (None: no buffer-only pipeline): its idle flag,
    the size of each kind of work it waits on, and this process's l3_write_dropped."""
    pipe = getattr(getattr(sched, "tree_cache", None), "buffer_pipeline", None)
    if pipe is None:
        return None
    work = " ".join(f"{n}={len(getattr(pipe, n, ()) or ())}" for n in _PIPE_WORK)
    dropped = {k: v for k, v in metrics.snapshot().items() if k.startswith("l3_write_dropped")}
    return f"idle={bool(pipe.is_idle())} {work} l3_write_dropped={dropped or 0}"


def _flush_cache(original: Callable, sched: Any, *args: Any, **kwargs: Any) -> Any:
    state = flush_state(sched)
    out = _agreed_flush(original, sched, *args, **kwargs)
    if state is not None:
        logger.info("sglang-l3: /flush_cache %s; L3 pipeline before it: %s", "done" if out else "refused", state)
    return out


def _agreed_flush(original: Callable, sched: Any, *args: Any, **kwargs: Any) -> Any:
    group = _flush_group(sched)
    if _world(group) > 1:
        local = bool(sched.is_fully_idle(ignore_waiting=sched._engine_paused))
        if not agree(group, local):
            metrics.inc("tp_flush_refused", "this_rank_busy" if not local else "other_rank_busy")
            logger.warning(
                "sglang-l3: /flush_cache refused on every TP rank: TP rank %d is %s",
                _rank(group),
                "busy" if not local else "idle, another rank is busy",
            )
            return False
    return original(sched, *args, **kwargs)


def _flush_wrapper_init(original: Callable, wrapper: Any, *args: Any, **kwargs: Any) -> Any:
    out = original(wrapper, *args, **kwargs)
    local_idle = wrapper._is_fully_idle
    sched = getattr(local_idle, "__self__", None)
    group = _flush_group(sched) if sched is not None else None
    wrapper._sglang_l3_group = group
    if _world(group) > 1:
        wrapper._is_fully_idle = lambda: agree(group, bool(local_idle()))
    return out


def _flush_check_pending(original: Callable, wrapper: Any) -> Any:
    pending = wrapper._pending
    group = getattr(wrapper, "_sglang_l3_group", None)
    if pending is None or _world(group) == 1:
        return original(wrapper)
    req, deadline = pending
    # A deadline on one rank's clock: time out only when some rank has, and then everywhere.
    expired = agree(group, time.monotonic() >= deadline, all_ranks=False)
    wrapper._pending = (req, -math.inf if expired else math.inf)
    try:
        return original(wrapper)
    finally:
        if wrapper._pending is not None:
            wrapper._pending = (req, deadline)


# --------------------------------------------------------------------------- #
# tp-verify-restores
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Decision:
    rid: str
    restored: int  # tokens restored from L3; -1: no restore this pass (fallback / kept staged)
    path_len: int  # device path length of the node the request is bound to

    def __str__(self) -> str:
        return f"(req={self.rid} restored={self.restored} path={self.path_len})"


_PENDING: list[Decision] = []  # scheduler thread only
# (pipeline, reanchor RestoreRecord) restored in this pass, verified before its forward
_TO_VERIFY: list[tuple[Any, Any]] = []


def _path_len(cache: Any, node: Any) -> int:
    try:
        return int(cache.path_device_indices(node).numel())
    except (
        AttributeError,
        KeyError,
        RuntimeError,
        TypeError,
    ):  # a node without a device path
        return -1


def _fault_here(cache: Any) -> bool:
    from sglang_l3 import faults

    arg = faults.argument(faults.RESTORE_FALLBACK)
    if arg is None:
        return False
    try:
        rank = int(arg)
    except ValueError as e:
        raise faults.FaultError(f"{faults.ENV}=restore-fallback@{arg}: the argument is a TP rank") from e
    return _rank(getattr(cache, "tp_group", None)) == rank


def _init_load_back(original: Callable, pipe: Any, params: Any) -> Any:
    req = params.req
    cache = pipe._cache
    if req is not None and pipe.staged_prefetches.get(req.cache_request_handle) is not None and _fault_here(cache):
        from sglang_l3 import faults
        from sglang_l3.patches.hicache.reanchor import fallback

        faults.spend(faults.RESTORE_FALLBACK)
        logger.warning(
            "sglang-l3: %s: injected restore fallback on this rank for %s",
            faults.ENV,
            req.rid,
        )
        fallback(pipe, req, "injected_fault")
        result = None
    else:
        result = original(pipe, params)
    if req is not None and verify_enabled():
        if result is None:
            _PENDING.append(Decision(str(req.rid), -1, _path_len(cache, req.last_node)))
        else:
            loaded, node = result
            _PENDING.append(Decision(str(req.rid), int(loaded), _path_len(cache, node)))
            from sglang_l3.patches.hicache.reanchor import record_of

            rec = record_of(req)
            if rec is not None and rec.load_back_id in pipe.ongoing_buffer_load_back:
                _TO_VERIFY.append((pipe, rec))
    return result


def _get_next_batch_to_run(original: Callable, sched: Any, *args: Any, **kwargs: Any) -> Any:
    out = original(sched, *args, **kwargs)
    if verify_enabled():
        check_decisions(_flush_group(sched))
        # The restored states, compared before the batch's forward advances them
        # (patch reanchor's check; at TP >= 2 its ack can come after that forward).
        from sglang_l3.patches.hicache.reanchor import verify_now

        todo = list(_TO_VERIFY)
        _TO_VERIFY.clear()
        for pipe, rec in todo:
            verify_now(pipe, rec)
    return out


def check_decisions(group: Any) -> None:
    """All-gather this pass's restore decisions; fail-stop on any difference."""
    mine = list(_PENDING)
    _PENDING.clear()
    if _world(group) == 1:
        return
    # Most passes restore nothing on any rank: one int reduction, no object gather.
    if not agree(group, bool(mine), all_ranks=False):
        return
    import torch.distributed as dist

    everyone: list[list[Decision] | None] = [None] * _world(group)
    dist.all_gather_object(everyone, mine, group=group)
    if mine:
        metrics.inc("verify_rank_checks")
    if any(other != everyone[0] for other in everyone[1:]):
        metrics.inc("rank_disagreements")
        metrics.inc("fail_stops")
        lines = "; ".join(f"TP rank {r}: [{', '.join(map(str, recs or []))}]" for r, recs in enumerate(everyone))
        msg = f"sglang-l3 verify: TP ranks made different L3 restore decisions, stopping: {lines}"
        logger.error(msg)
        raise RankDisagreement(msg)


# --------------------------------------------------------------------------- #
def apply(ctx: PatchContext) -> None:
    if ctx.id == "tp-agreed-sidecar-heal":
        ctx.around(f"{URC}._check_hybrid_prefetch_result", _check_hybrid_prefetch_result)
    elif ctx.id == "tp-agreed-flush":
        ctx.around(f"{SCHED}.flush_cache", _flush_cache)
        ctx.around(f"{FLUSH}.__init__", _flush_wrapper_init)
        ctx.around(f"{FLUSH}.check_pending", _flush_check_pending)
    elif ctx.id == "tp-verify-restores":
        ctx.around(f"{PIPE}.init_load_back", _init_load_back)
        ctx.around(f"{SCHED}.get_next_batch_to_run", _get_next_batch_to_run)
    else:
        raise ValueError(f"tp agreement: unknown patch id {ctx.id!r}")
