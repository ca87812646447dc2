"""Patch `branch-backup` (why: patches/series.toml): a Mamba state committed to a
node in buffer-only mode reaches L3.

How: AROUND `UnifiedRadixCache.insert` (above both tree cores, Rust default and
Python). When the insert committed a Mamba state (`mamba_value` given and
`result.mamba_exist` false) onto a node whose KV the write policy has already
chosen for L3 — admitted by this insert's walk (captured AROUND `end_insert_walk`)
or believed stored/in flight — it calls upstream's own `enqueue_backup_intent`
again, now that the state is there. Upstream skips pools already covered, so only
the Mamba page is written.

TP lockstep: every input to the decision (insert params, `mamba_exist`, the
walk's admitted set, in-flight pools, the existence cache) is what upstream's
backup path itself decides from, and it is identical on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.branch_backup")

CACHE = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"

# The walk's admitted-node set, kept past end_insert_walk for the AROUND insert.
LAST_WALK_ATTR = "_sglang_l3_last_walk_admitted"


def _end_insert_walk(original: Any, pipe: Any) -> Any:
    setattr(pipe, LAST_WALK_ATTR, pipe._walk_admitted)
    return original(pipe)


def _kv_chosen_for_l3(cache: Any, pipe: Any, node_id: Any, walk: set | None) -> bool:
    """The write policy already sent this node's KV to L3 (or is sending it)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    if walk is not None and node_id in walk:
        return True
    if PoolName.KV in pipe.inflight_backup_pools.get(node_id, ()):
        return True
    snap = cache.tree_core.snapshot_buffer_backup(node_id, False)
    return snap is not None and cache.storage_existence_cache.pool(PoolName.KV).covered(snap.hash_values)


def backup_committed_state(cache: Any, node_id: Any, walk: set | None) -> bool:
    """Queue the Mamba page of a freshly committed state; True when queued."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pipe = cache.buffer_pipeline
    if PoolName.MAMBA in pipe.inflight_backup_pools.get(node_id, ()):
        return False  # a new leaf: upstream's tail step already queued it after commit
    if not _kv_chosen_for_l3(cache, pipe, node_id, walk):
        return False  # e.g. write_through_selective below its hit threshold
    pipe.enqueue_backup_intent(node_id)
    queued = PoolName.MAMBA in pipe.inflight_backup_pools.get(node_id, ())
    metrics.inc("branch_backups", "queued" if queued else "not_queued")
    logger.debug("sglang-l3 branch-backup: node=%s mamba queued=%s", node_id, queued)
    return queued


def _insert(original: Any, cache: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(cache, params, *args, **kwargs)
    pipe = getattr(cache, "buffer_pipeline", None)
    # This insert's walk set, taken on every path: a set left behind would be read
    # by a later insert whose walk never reached end_insert_walk.
    walk = vars(pipe).pop(LAST_WALK_ATTR, None) if pipe is not None else None
    if (
        pipe is None
        or not cache.enable_storage
        or getattr(params, "mamba_value", None) is None
        or result.mamba_exist
        or result.last_device_node is None
    ):
        return result
    backup_committed_state(cache, result.last_device_node, walk)
    return result


def apply(ctx: PatchContext) -> None:
    ctx.around(f"{PIPE}.end_insert_walk", _end_insert_walk)
    ctx.around(f"{CACHE}.insert", _insert)
