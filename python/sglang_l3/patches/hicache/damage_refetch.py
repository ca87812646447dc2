"""Patch `damage-refetch` (why: patches/series.toml): a storage hit whose read finds
a damaged page restores the longest prefix that is still intact, not 0.

How: AROUND `UnifiedRadixCache._check_hybrid_prefetch_result`, upstream's
all-or-nothing rule for a hybrid (KV + Mamba) prefetch. When upstream discards a
fetch whose IO ran to its end but came back short (a KV page or the Mamba state that
some rank could not read: the store's checksum or size check failed and moved the
page to quarantine), the request's prefetch is re-issued once through upstream's own
re-issue queue (`StoragePrefetchRetries.refetch`, the path upstream takes when a hit's
anchor is lost). The re-issue runs a fresh hit query; the damaged page is gone from
that rank's store, so the per-length restorable flags, MIN-reduced across the TP ranks
by upstream (`_sync_prefetch_hit_query`), end at the longest prefix ending at a stored
Mamba checkpoint that every rank still holds. The request waits for it in the queue
(the re-issue goes out in the same scheduler step, `_process_hicache_events`, right
after the drain that discarded the fetch) and computes the rest.

Not re-issued: a fetch cut by the stop policy or an abort (terminated, or its deadline
expired: no evidence of damage), and a request past `MAX_REFETCHES` re-issues of its
own (a store that keeps failing without quarantining, e.g. an IO error); upstream's
re-issue cap (`--hicache-storage-prefetch-retry-max-attempts`) bounds it too.

Covers what upstream reads itself: a hit that fits the host buffer, and the final
round of a streamed restore (its last piece and the state). Pieces of a streamed
restore are cut in place, keeping what landed (patch `streamed-restore`).

TP: every input (the op's MIN-reduced completion and pool hits, its termination and
deadline flags, set at rank-agreed points, and the per-request count) is identical on
every rank, and the discard runs in the rank-synced ack drain.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.damage_refetch")

URC = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
MAX_REFETCHES = 3  # per request; each damaged page found is quarantined, so one usually suffices
_COUNTS = "_l3_damage_refetches"
_KEEP = 4096  # requests remembered (the oldest are forgotten first)


def _count(cache: Any, rid: str) -> int:
    counts = cache.__dict__.get(_COUNTS)
    if counts is None:
        counts = cache.__dict__[_COUNTS] = OrderedDict()
    n = counts.pop(rid, 0) + 1
    counts[rid] = n
    while len(counts) > _KEEP:
        counts.popitem(last=False)
    return n


def apply(ctx: PatchContext) -> None:
    def check(orig: Any, self: Any, request: Any, operation: Any, hash_value: list, host_indices: Any) -> bool:
        ok = orig(self, request, operation, hash_value, host_indices)
        if ok or operation.deadline_expired or operation.is_terminated():
            return ok
        n = _count(self, request.rid)
        if n > MAX_REFETCHES:
            metrics.inc("l3_restore_refetch", "capped")
            return ok
        self.storage_prefetch_retries.refetch(request.rid)
        metrics.inc("l3_restore_refetch", "damage")
        ctx.fired("refetch")
        logger.warning(
            "L3 hit re-queried after a read failure req=%s attempt=%d read=%d of %d tokens",
            request.rid,
            n,
            operation.completed_tokens,
            len(hash_value) * self.page_size,
        )
        return ok

    ctx.around(f"{URC}._check_hybrid_prefetch_result", check)
