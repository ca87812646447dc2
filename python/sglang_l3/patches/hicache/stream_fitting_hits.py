"""Patch `stream-fitting-hits` (why: patches/series.toml): a buffer-only L3 hit that
fits the host staging buffer is restored in rounds too, as patch `streamed-restore`
restores a larger one, so its host -> device copies overlap its store reads.

How: AROUND `BufferModePipeline.allocate_and_queue_prefetch`, inside stream-share's
wrapper and outside streamed-restore's. A hit is taken (`takes`) when

- no stream exists for its request (a started one is streamed-restore's from then on:
  its state machine answers every later try of the parked op),
- it fits an empty host arena (`can_fit_prefetch_host_buffers`: larger ones are
  streamed-restore's own),
- it is longer than one piece (`piece_tokens`: at least two rounds, so at least one
  piece's copy overlaps a read), and
- the stop policy is not `best_effort`, which stops a stream at the first poll and
  recomputes: such a hit keeps upstream's staged path, which best_effort waits for.

A taken hit goes to `streamed_restore.start_stream(..., fitting=True)`, which reads it
in pieces of 1/8 of the hit (`streamed_restore.FITTING_ROUNDS`: with regular pieces,
0.4 of the pool, a 1.2x buffer gives three rounds whose two reads run side by side and
leave little to overlap). A started stream parks the op (anchor lock released, False: the path streamed-restore uses).
Device rows are taken only when free + evictable rows take the whole hit now (the fit
is MIN-reduced across TP ranks at the start); otherwise, or when the stream declines
(silently), upstream's own path gets the op with its hit unchanged: read into host,
copied at admission, as before. Counted in `l3_stream_restore{started}` and
`{fitting}`. Every input of the decision is the same on every rank (lane state, host
pool size, the op's hit, the policy) and the collective inside `start_stream` runs at
the hit drain's lockstep point, as for any stream start.
"""

from __future__ import annotations

from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches import framework
from sglang_l3.patches.framework import PatchContext
from sglang_l3.patches.hicache.streamed_restore import Stream, lane_of, piece_tokens, start_stream

PATCH_ID = "stream-fitting-hits"
PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"


def takes(pipe: Any, op: Any, hit_tokens: int) -> bool:
    """Whether this patch streams `op`'s hit of `hit_tokens` (rather than leaving it to
    upstream's staged path) when it is tried now: False unless the patch is applied."""
    if not framework.is_applied(PATCH_ID) or op.handle in lane_of(pipe).streams:
        return False
    cache = pipe._cache
    return (
        cache.prefetch_stop_policy != "best_effort"
        and hit_tokens > piece_tokens(pipe)
        and cache.cache_controller.can_fit_prefetch_host_buffers(op, hit_tokens)
    )


def apply(ctx: PatchContext) -> None:
    def allocate(orig: Any, self: Any, op: Any, info: Any, hit_tokens: int, aux_hit_tokens: int) -> bool:
        if not takes(self, op, hit_tokens):
            return orig(self, op, info, hit_tokens, aux_hit_tokens)
        started = start_stream(self, op, hit_tokens, fitting=True)
        if not isinstance(started, Stream):
            # None (declined) or UPSTREAM (the device cannot take the whole hit now):
            # upstream's staged path, the hit unchanged.
            return orig(self, op, info, hit_tokens, aux_hit_tokens)
        metrics.inc("l3_stream_restore", "fitting")
        self.release_anchor_lock(op.handle)  # parked ops hold no pin; the stream has its own
        return False

    ctx.around(f"{PIPE}.allocate_and_queue_prefetch", allocate)
