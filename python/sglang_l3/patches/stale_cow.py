"""Patch `stale-cow`: no stale Mamba copy-on-write source on admission `continue`s.

In the admission loop (`Scheduler._get_new_batch_prefill_raw`, scheduler.py
4260-4299) `req.init_next_round_input()` can allocate the request's private
Mamba slot and point `mamba_cow_src_index` at the matched node's slot. When
the request is then *not* admitted, the loop's cleanup (4289-4299) clears the
CoW/clear metadata and frees the fresh slot — but two `continue`s skip it:
after `_prefetch_after_device_hit_loss` returns True (4261-4264) and after
`prepare_staged_prefetch` returns False ("shrunk", 4265-4269). If the CoW
source's state is evicted and its slot reused before the request is admitted
without a staged load, `HybridReqToTokenPool.alloc` keeps the slot without
`mamba_needs_clear` and the deferred CoW copies another request's state in as
the initial Gated-DeltaNet state: silently wrong output.

The patch applies exactly the loop's own not-admitted cleanup when either call
reports "not this pass". Both methods are called only from that loop, right
after init_next_round_input.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.stale_cow")

SCHED = "sglang.srt.managers.scheduler:Scheduler"
PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"


def release_unadmitted_mamba(req: Any, req_to_token_pool: Any, where: str) -> None:
    """Mirror of scheduler.py:4289-4299 for a request that stays queued."""
    kv = req.kv
    had_cow = kv.mamba_cow_src_index is not None or kv.mamba_needs_clear
    kv.mamba_cow_src_index = None
    kv.mamba_needs_clear = False
    freed = False
    if kv.holds_mamba and not getattr(req, "session", None):
        req_to_token_pool.mamba_allocator.free(kv.mamba_pool_idx.unsqueeze(-1))
        kv.mamba_pool_idx = None
        freed = True
    if had_cow or freed:
        metrics.inc("stale_cow_cleanups", where)
        logger.debug("sglang-l3 stale-cow: req=%s cleaned on %s (cow=%s freed=%s)", req.rid, where, had_cow, freed)


def _prefetch_after_device_hit_loss(original, sched: Any, req: Any) -> Any:
    deferred = original(sched, req)
    if deferred:
        release_unadmitted_mamba(req, sched.tree_cache.req_to_token_pool, "device_hit_loss")
    return deferred


def _prepare_staged_prefetch(original, pipe: Any, req: Any) -> Any:
    ready = original(pipe, req)
    if not ready:
        release_unadmitted_mamba(req, pipe._cache.req_to_token_pool, "staged_shrunk")
    return ready


def apply(ctx: PatchContext) -> None:
    ctx.around(f"{SCHED}._prefetch_after_device_hit_loss", _prefetch_after_device_hit_loss)
    ctx.around(f"{PIPE}.prepare_staged_prefetch", _prepare_staged_prefetch)
