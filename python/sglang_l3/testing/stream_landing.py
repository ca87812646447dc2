"""What a scheduler-loop stand-in (`stack.wait_for_work`) waits on while a streamed
restore reads: read-only views of patch `streamed-restore`'s lane
(`streamed_restore.lane_if_any`), which only the harness needs, so they live here
rather than in the runtime module."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from sglang_l3.patches.hicache.streamed_restore import lane_if_any


def landing_futures(pipe: Any) -> list[Future]:
    """The read each of `pipe`'s streams lands next (its first piece in flight): a
    scheduler loop, or a harness standing in for one, may block on them instead of
    polling. Only these: a tick lands pieces in order, so a later piece read first
    changes nothing until the one before it is done (a loop that woke on it would
    tick for nothing until then)."""
    lane = lane_if_any(pipe)
    return [] if lane is None else [s.pieces[0].future for s in lane.streams.values() if s.pieces]


def copies_completed(pipe: Any) -> bool:
    """Whether a copy of `pipe`'s streams has completed here and its buffers wait for the
    next tick to be freed (a stream's oldest copy, or a retiring one). Upstream's scheduler
    loop ticks again at once while a prefetch is in progress (`on_idle`: `time.sleep(0)`),
    so the freed host slots take the next read then, beside the one in flight; a harness
    standing in for that loop ticks now rather than sleep until the next piece lands."""
    lane = lane_if_any(pipe)
    if lane is None:
        return False
    firsts = [s.copying[0].copied for s in lane.streams.values() if s.copying]
    firsts += [r.copied for r in lane.retiring[:1]]
    return any(bool(ev.query()) for ev in firsts)
