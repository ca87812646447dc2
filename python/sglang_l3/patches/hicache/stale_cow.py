"""Patch `stale-cow` (why: patches/series.toml): no stale Mamba copy-on-write
source on admission `continue`s.

How: AROUND `Scheduler._prefetch_after_device_hit_loss` (when it returns True) and
`BufferModePipeline.prepare_staged_prefetch` (when it returns False, "shrunk"), apply
exactly the admission loop's own not-admitted cleanup (clear the CoW/clear metadata,
free the fresh private Mamba slot). Both methods are called only from that loop
(`Scheduler._get_new_batch_prefill_raw`), right after init_next_round_input.
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
    """Mirror of the admission loop's not-admitted cleanup, for a request that stays queued."""
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
