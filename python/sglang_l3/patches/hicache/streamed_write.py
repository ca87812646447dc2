"""Patch `streamed-write` (why: patches/series.toml): a KV span larger than the
host staging buffer goes to L3 in windows.

How: a KV intent longer than the window W is staged window by window while it
stays at the head of the write FIFO (design W-1 of the streamed-staging study):

- `_backup_oversize` judges a KV intent by min(tokens, W); aux pools unchanged.
- `_launch_transfers` slices the node's rows and keys to `[c, c+W)`, c = the first
  page not covered by KV beliefs (stored or in flight), so each window starts
  where the previous ones ended.
- `_stage_backup_intent`: on success with pages left, the intent goes back to
  index 1 of the FIFO (`flush_pending_writes` pops index 0 next) with its
  queued-span ref and in-flight mark.
- `finish_backup_ack`: a window at c > 0 extends the write's `prefix_keys` by the
  node's first c page hashes (the store's chain position), on a copy of the intent.
- `finish_storage_write_ack`: upstream clears the node's "KV in flight" mark at the
  storage ack of any KV write of the node; with windows that was the first window's
  ack, while the rest of the node was still queued. Its children then failed the
  parent-cover gate (`_backup_parent_covered`: in flight, or the parent's last page
  believed stored) and were dropped as `parent_not_stored` — a turn written right
  after a long one lost its L3 copy. The mark is put back while a window of the node
  is still queued, staged or awaiting its storage ack, so the child waits behind it.

The Mamba intent of the node sits behind the KV intent (`_pool_order`), so the
checkpoint is staged after the last KV window, as today. Window sizes come from
the pool size and the cursor from beliefs: identical on every TP rank.
What is still dropped (parent not stored: the parent's own write was dropped or
swept with its evicted node; backlog cap; an aux pool too big) is counted by reason
in `l3_write_dropped{reason}`. So is a queued write whose node the device evicted
before it staged (`evicted`: upstream's `_split_pieces` finds nothing left and sweeps
the intent; upstream pins a node only from its D2H launch, so under load, with a
small host buffer, the next request's prefill or a restore can take its rows before its
write reached L3, and the context is recomputed when it returns).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import msgspec

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.streamed_write")

PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"
ENV_WINDOW = "SGLANG_L3_STREAM_WRITE_WINDOW"  # fraction of the host KV pool per window
DEFAULT_WINDOW_FRACTION = 0.25


def window_tokens(pipe: Any) -> int:
    """Tokens per write window: a page-aligned fraction of the host KV pool, >= 1 page."""
    cache = pipe._cache
    page = cache.page_size
    pool = cache.cache_controller.mem_pool_host.size
    frac = float(os.environ.get(ENV_WINDOW, DEFAULT_WINDOW_FRACTION))
    return max(page, int(pool * frac) // page * page)


def _state(pipe: Any) -> dict[str, Any]:
    st = pipe.__dict__.get("_l3_stream_write")
    if st is None:
        st = pipe.__dict__["_l3_stream_write"] = {
            "pending": None,
            "cursor": {},
            "windows": 0,
        }
    return st


def _first_uncovered(beliefs: Any, keys: list[str]) -> int | None:
    for i, k in enumerate(keys):
        if not beliefs.covered((k,)):
            return i
    return None


def _keep_inflight_while_windows_remain(pipe: Any, intent: Any) -> None:
    """After a window's storage ack: the node's KV stays "in flight" while another
    window of it is queued, staged (D2H) or awaiting its storage ack."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    if intent.pool != PoolName.KV:
        return
    node = intent.snapshot.node_id

    def same(i: Any) -> bool:
        return i.pool == PoolName.KV and i.snapshot.node_id == node

    if (
        any(same(i) for i in pipe.pending_write_queue)
        or any(same(e.intent) for e in pipe.ongoing_write_through.values())
        or any(same(e.intent) for e in pipe.ongoing_backup.values())
    ):
        pipe.inflight_backup_pools.setdefault(node, set()).add(PoolName.KV)


def apply(ctx: PatchContext) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    def backup_oversize(orig: Any, self: Any, kv_tokens: int, aux_xfers: list) -> bool:
        over = orig(self, min(kv_tokens, window_tokens(self)), aux_xfers)
        if over:
            metrics.inc("l3_write_dropped", "aux_oversize")
        return over

    def parent_covered(orig: Any, self: Any, *args: Any, **kwargs: Any) -> bool:
        ok = orig(self, *args, **kwargs)
        if not ok:
            metrics.inc("l3_write_dropped", "parent_not_stored")
        return ok

    def split_pieces(orig: Any, self: Any, snapshot: Any) -> Any:
        pieces = orig(self, snapshot)
        if pieces is None:  # the queued span left the device unwritten: upstream sweeps it
            metrics.inc("l3_write_dropped", "evicted")
            logger.warning(
                "L3 write dropped: node %s (%d tokens) was evicted from the device before its write staged",
                snapshot.node_id,
                len(snapshot.key),
            )
        return pieces

    def enqueue(orig: Any, self: Any, node_id: Any) -> None:
        before = getattr(self, "_backlog_cap_hits", 0)
        orig(self, node_id)
        if getattr(self, "_backlog_cap_hits", 0) != before:
            metrics.inc("l3_write_dropped", "backlog_cap")

    def launch(orig: Any, self: Any, intent: Any) -> Any:
        st = _state(self)
        st["pending"] = None
        res = orig(self, intent)
        if res is None or intent.pool != PoolName.KV:
            return res
        device_value, keys_by_pool, transfers = res
        keys = keys_by_pool.get(PoolName.KV) or []
        page = self._cache.page_size
        wp = window_tokens(self) // page
        if len(keys) <= wp:
            return res
        c = _first_uncovered(self._cache.storage_existence_cache.pool(PoolName.KV), keys)
        if c is None:
            return res  # all covered: upstream retires the intent
        end = min(c + wp, len(keys))
        win_keys = list(keys[c:end])
        new_by_pool = {pool: list(k[c:end]) for pool, k in keys_by_pool.items()}
        new_xfers = []
        for t in transfers:
            if t.indices_from_pool == PoolName.KV and t.keys is not None:
                t = dataclasses.replace(t, keys=list(win_keys))
            new_xfers.append(t)
        st["pending"] = (intent, c, end < len(keys))
        return device_value[c * page : end * page], new_by_pool, new_xfers

    def stage(
        orig: Any,
        self: Any,
        intent: Any,
        device_value: Any,
        transfers: Any,
        keys_by_pool: Any,
    ) -> bool:
        st = _state(self)
        pending, st["pending"] = st["pending"], None
        ok = orig(self, intent, device_value, transfers, keys_by_pool)
        if not ok or pending is None or pending[0] is not intent:
            return ok
        _, c, more = pending
        ack_id = -(1 << 40) - self._backup_ack_seq
        st["cursor"][ack_id] = c
        st["windows"] += 1
        metrics.inc("l3_stream_write_windows")
        if more:
            # The flush loop pops index 0 (this intent) next; the copy at 1 stays the head.
            self.pending_write_queue.insert(1, intent)
            self._retain_queued_span(intent)
            self.inflight_backup_pools.setdefault(intent.snapshot.node_id, set()).add(intent.pool)
        return ok

    def backup_ack(orig: Any, self: Any, ack_id: int) -> None:
        c = _state(self)["cursor"].pop(ack_id, None)
        if c:
            entry = self.ongoing_write_through[ack_id]
            snap = entry.intent.snapshot
            if snap.prefix_keys is not None:
                prefix = self._cache.cache_controller.extend_storage_prefix(
                    snap.prefix_keys, list(snap.hash_values[:c])
                )
                snap = msgspec.structs.replace(snap, prefix_keys=prefix)
                # A copy: the same intent object may still be queued for the next window.
                entry.intent = msgspec.structs.replace(entry.intent, snapshot=snap)
        return orig(self, ack_id)

    def storage_ack(orig: Any, self: Any, operation_id: int) -> None:
        entry = self.ongoing_backup.get(operation_id)
        orig(self, operation_id)
        if entry is not None:
            _keep_inflight_while_windows_remain(self, entry.intent)

    def reset(orig: Any, self: Any) -> None:
        orig(self)
        self.__dict__.pop("_l3_stream_write", None)

    ctx.around(f"{PIPE}._backup_oversize", backup_oversize)
    ctx.around(f"{PIPE}._backup_parent_covered", parent_covered)
    ctx.around(f"{PIPE}._split_pieces", split_pieces)
    ctx.around(f"{PIPE}.enqueue_backup_intent", enqueue)
    ctx.around(f"{PIPE}._launch_transfers", launch)
    ctx.around(f"{PIPE}._stage_backup_intent", stage)
    ctx.around(f"{PIPE}.finish_backup_ack", backup_ack)
    ctx.around(f"{PIPE}.finish_storage_write_ack", storage_ack)
    ctx.around(f"{PIPE}.reset", reset)
