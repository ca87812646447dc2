"""Upstream's strict idle leak check over an `L3Stack`, as `Scheduler.on_idle` runs it.

`Scheduler.on_idle` checks the pools only when `Scheduler.is_fully_idle` holds (no
request, no HiCache operation in flight, the buffer-only pipeline idle), and then
requires every device row and Mamba slot to be free, evictable, protected or held by a
session (`SchedulerInvariantChecker._check_all_pools`); with
SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE (on by default) a miss raises and the
scheduler exits. Both are upstream's own code here, run on a `Scheduler.__new__`
stand-in that carries only what they read. A test calls `check(stack)` after every
tick: whatever the cache holds across ticks must either keep the scheduler busy or be
visible to the check.
"""

from __future__ import annotations

import types
from typing import Any

from sglang_l3.testing.stack import L3Stack


class IdleLeak(AssertionError):
    """Upstream's idle check would have stopped the scheduler here."""


class _NoStaging:
    def any_staging_reqs(self) -> bool:
        return False


def scheduler_view(stack: L3Stack) -> Any:
    """A `Scheduler` carrying what `is_fully_idle` reads: no request anywhere, the stack's
    cache as its tree cache, HiCache with storage on."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    s = Scheduler.__new__(Scheduler)
    s.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    s.chunked_req = None
    s.dllm_manager = _NoStaging()
    s.last_batch = None
    s.enable_overlap = False
    s.waiting_queue = []
    s.grammar_manager = types.SimpleNamespace(grammar_queue=[])
    s.disaggregation_mode = DisaggregationMode.NULL
    s.enable_hisparse = False
    s.enable_hierarchical_cache = True
    s.enable_lmcache = False
    s.tree_cache = stack.cache
    s._engine_paused = False
    return s


def _checker(stack: L3Stack) -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
    from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver

    common = {
        "tree_cache": stack.cache,
        "token_to_kv_pool_allocator": stack.allocator,
        "req_to_token_pool": stack.req_to_token_pool,
        "is_hybrid_swa": False,
        "is_hybrid_ssm": True,
        "full_tokens_per_layer": None,
        "swa_tokens_per_layer": None,
        "max_total_num_tokens": stack.allocator.size,
    }
    observer = SchedulerPoolStatsObserver(
        session_controller=types.SimpleNamespace(sessions={}),
        hisparse_coordinator=None,
        enable_hisparse=False,
        **common,
    )
    return SchedulerInvariantChecker(
        disaggregation_mode=DisaggregationMode.NULL,
        page_size=stack.spec.page_size,
        pool_stats_observer=observer,
        get_last_batch=lambda: None,
        get_running_batch=lambda: None,
        scheduler_stage_metrics=None,
        **common,
    )


def fully_idle(stack: L3Stack) -> bool:
    """Upstream's `Scheduler.is_fully_idle` for a scheduler with no request."""
    from sglang.srt.managers.scheduler import Scheduler

    return bool(Scheduler.is_fully_idle(scheduler_view(stack)))


def pool_leaks(stack: L3Stack) -> list[str]:
    """The messages of upstream's idle pool check when it finds rows nobody accounts for
    (empty: the invariant holds), whether or not the scheduler would be idle now."""
    checker = _checker(stack)
    has_leak, messages = checker._check_all_pools(checker.pool_stats_observer.get_pool_stats())
    return [m for m in messages if m] if has_leak else []


def check(stack: L3Stack, what: str = "") -> bool:
    """Run upstream's idle check where `on_idle` would (when fully idle): raise IdleLeak
    naming what holds the rows if it fails. Returns whether the scheduler was idle."""
    if not fully_idle(stack):
        return False
    leaks = pool_leaks(stack)
    if leaks:
        raise IdleLeak(f"upstream's strict idle check fails{f' ({what})' if what else ''}: " + "; ".join(leaks))
    return True
