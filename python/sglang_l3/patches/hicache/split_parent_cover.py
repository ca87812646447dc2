"""Patch `split-parent-cover` (why: patches/series.toml): a turn inserted over a node
whose L3 write is already past its D2H launch reaches L3 too.

How: AROUND `BufferModePipeline._backup_parent_covered`. When upstream refuses a
node's write because its parent is neither in flight (by node id) nor believed
stored, the parent also counts as covered when its last page is in flight to the
store: the KV beliefs' `covered`, which also counts content past a D2H launch (the
test upstream's `_pool_covered` applies to a node's own pages). That is the parent a
split leaves when a turn is inserted inside another node whose write was launched
but not yet acknowledged: the launched write carries the split parent's pages under
the original node's id, and the walk queues nothing for the split parent, because
its pages are already covered.

TP: the beliefs' in-flight marks are set at the D2H launch (the FIFO flush, the same
on every rank) and, at the storage ack, turned into stored beliefs by upstream's
rank-synced drain, which adds them whatever one rank's backend said
(`finish_storage_write_ack`); so the parent is covered from the launch on, on every
rank alike. A page the store then lacks is a miss at read time, as for any write
upstream believes stored.
"""

from __future__ import annotations

from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"


def parent_in_flight(pipe: Any, state: Any) -> bool:
    """The parent's last page is past its D2H launch (or stored)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    last = getattr(state, "parent_last_hash", None)
    return last is not None and pipe._cache.storage_existence_cache.pool(PoolName.KV).covered((last,))


def apply(ctx: PatchContext) -> None:
    def parent_covered(orig: Any, self: Any, state: Any, *args: Any, **kwargs: Any) -> bool:
        if orig(self, state, *args, **kwargs):
            return True
        if parent_in_flight(self, state):
            metrics.inc("l3_write_parent_in_flight")
            return True
        return False

    ctx.around(f"{PIPE}._backup_parent_covered", parent_covered)
