"""Patch `stream-share` (why: patches/series.toml): requests that want one long L3
prefix at once, or whose streamed restores together overfill the device pool, never
wait forever on each other (issue 24).

A streamed restore (patch `streamed-restore`) holds private device rows R from its
start until its request is admitted. Two things went wrong with that in a burst:

- Share: X2 wants the prefix X1 is streaming. Upstream's parked-hit FIFO holds X2's
  hit until X1's stream reaches its final round, then X2 started a second restore of
  the same pages, cut short to what the device pool had left beside X1's R
  (`l3_stream_restore{truncated_device}`). Now X2's hit stays parked (no rows, no pin:
  `allocate_and_queue_prefetch` returns False, upstream's path for a busy budget)
  while another request's live stream covers the start of X2's span. When X1 is
  admitted its span is in the tree, and X2's next try finds it there (upstream
  declines the hit as device-covered, or trims it to the part past the device
  prefix): X2 shares X1's restore. When X1's stream ends without publishing (abort,
  dropped hold, storage error), X2 starts its own. X2's stop policy applies while it
  waits (`timeout`: the budget, then it recomputes; `best_effort`: recompute at once).
- Yield: FCFS admission stops at the first request that does not fit. When that
  happens on an idle scheduler (nothing running, nothing admitted this pass: nothing
  will free memory by itself), the rows of streams other requests hold are released:
  a stream still reading is aborted and its parked hit revoked; a staged one drops
  its hold (`release_staged_hold`, reason device_capacity). Those requests ask L3
  again on the next pass (upstream's immediate re-issue, `StoragePrefetchRetries.refetch`)
  and restore or, once the head's prefix is in the tree, share it. Without this, X1 (its staged
  hold dropped after 32 device_capacity deferrals) waited at the head for rows that
  X2's staged stream behind it held, and X2 was never reached: both hung.
  A stream in its final round is left alone (upstream's read of the last piece is in
  flight); it is staged a few ticks later and yields then.

A hit that fits the host buffer is a stream's too when patch `stream-fitting-hits`
takes it (`stream_fitting_hits.takes`), and waits for an owner alike.

Both decisions read only rank-identical state (the lane's streams, the parked hit,
the admission result) at lockstep points, so every TP rank makes them alike.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext
from sglang_l3.patches.hicache import stream_fitting_hits
from sglang_l3.patches.hicache.streamed_restore import Stream, abort_stream, lane_of

logger = logging.getLogger("sglang_l3.stream_share")

PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"
ADDER = "sglang.srt.managers.schedule_policy:PrefillAdder"
LIVE = ("reading", "ready", "final", "staged")  # states in which a stream holds R


def _span_keys(s: Stream) -> set[str]:
    """L3 page keys of the span a stream restores: R's pages and the last piece's."""
    keys = set(s.keys)
    keys.update(s.op.hash_value or ())
    if s.f is not None:
        keys.update(s.f[2])
    return keys


def owner_of(pipe: Any, op: Any) -> Stream | None:
    """Another request's live stream that restores the start of `op`'s span (or
    whose span starts inside it). Keys are a hash chain from the root: an equal key
    is an equal prefix."""
    keys = list(op.hash_value or ())
    if not keys:
        return None
    mine = set(keys)
    for s in lane_of(pipe).streams.values():
        if s.handle == op.handle or s.state not in LIVE:
            continue
        if keys[0] in _span_keys(s) or (s.keys and s.keys[0] in mine):
            return s
    return None


def _waits(pipe: Any) -> dict[Any, str]:
    """Request handle -> rid of the stream its hit waits for (logged once per wait)."""
    w = pipe.__dict__.get("_l3_share_waits")
    if w is None:
        w = pipe.__dict__["_l3_share_waits"] = {}
    if len(w) > 64:  # requests that left while waiting
        live = pipe._cache.ongoing_prefetch
        for h in [h for h in w if h not in live]:
            del w[h]
    return w


def yield_rows(pipe: Any, head: Any) -> int:
    """Release the device rows of other requests' streams (the admission head `head`
    cannot be admitted on an idle scheduler). Returns the rows released or scheduled
    for release at the next tick."""
    cache = pipe._cache
    mine = getattr(head, "cache_request_handle", None)
    released = 0
    for s in list(lane_of(pipe).streams.values()):
        if s.handle == mine or not len(s.rows) or s.state in ("final", "aborting"):
            continue
        rows = len(s.rows)
        logger.warning(
            "streamed restore of req=%s yields %d device rows (state %s) to req=%s, which the idle scheduler "
            "cannot admit; req=%s asks L3 again next pass or shares what is in the tree",
            s.handle.rid,
            rows,
            s.state,
            getattr(head, "rid", "?"),
            s.handle.rid,
        )
        metrics.inc("l3_stream_yield")
        if s.state == "staged":
            pipe.release_staged_hold(s.handle, reason="device_capacity")  # ends the stream, frees R now
        else:
            abort_stream(pipe, s, "yielded")  # the tick frees R once its reads are back
            if s.handle in cache.ongoing_prefetch:
                cache.revoke_pending_prefetch(s.handle)  # parked op, no host slots of upstream's
        refetch_after_yield(cache, s)
        released += rows
    return released


def refetch_after_yield(cache: Any, s: Stream) -> None:
    """The yielded request asks L3 again on the next pass (upstream's immediate re-issue,
    as after its own anchor loss): it lost its hit to the head, not to the store. Without
    it the request was admitted on what the device held, often nothing of a hybrid model's
    context (no Mamba state there), and recomputed all of it though L3 had it. Upstream's
    re-issue cap bounds how often a request can lose its rows this way."""
    retries = getattr(cache, "storage_prefetch_retries", None)
    if retries is not None:
        # no end given: a cut stream's hit was shorter than what L3 holds
        retries.refetch(s.handle.rid, None)
        metrics.inc("l3_stream_restore", "refetch_yielded")


# ------------------------------------------------------------------------ hooks
def apply(ctx: PatchContext) -> None:
    def allocate(orig: Any, self: Any, op: Any, info: Any, hit_tokens: int, aux_hit_tokens: int) -> bool:
        lane = lane_of(self)
        waits = _waits(self)
        if op.handle not in lane.streams and (
            not self._cache.cache_controller.can_fit_prefetch_host_buffers(op, hit_tokens)
            or stream_fitting_hits.takes(self, op, hit_tokens)
        ):
            # This hit would start a stream (rows now, published at admission): larger
            # than the host buffer, or one patch stream-fitting-hits streams.
            owner = owner_of(self, op)
            if owner is not None:
                if waits.get(op.handle) != owner.handle.rid:
                    waits[op.handle] = owner.handle.rid
                    metrics.inc("l3_stream_restore", "wait_shared")
                    logger.info(
                        "streamed restore req=%s waits for req=%s, which restores the same prefix (state %s)",
                        op.handle.rid,
                        owner.handle.rid,
                        owner.state,
                    )
                self.release_anchor_lock(op.handle)  # parked ops hold no pin
                return False
        waits.pop(op.handle, None)
        return orig(self, op, info, hit_tokens, aux_hit_tokens)

    def add_one_req(orig: Any, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        from sglang.srt.managers.schedule_policy import AddReqResult

        res = orig(self, req, *args, **kwargs)
        if res is not AddReqResult.NO_TOKEN or self.can_run_list:
            return res
        if self.running_batch is not None and self.running_batch.reqs:
            return res  # running work frees memory by itself (upstream's idle test)
        pipe = getattr(self.tree_cache, "buffer_pipeline", None)
        if pipe is not None and lane_of(pipe).streams:
            yield_rows(pipe, req)
        return res

    ctx.around(f"{PIPE}.allocate_and_queue_prefetch", allocate)
    ctx.around(f"{ADDER}.add_one_req", add_one_req)
