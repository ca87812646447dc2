"""What a scheduler-loop stand-in waits on while a streamed restore reads
(`testing.stream_landing.landing_futures`, used by `testing.stack.wait_for_work`): the read
each stream lands next, not every read in flight. A tick lands pieces in order, so a
loop woken by a later piece read first ticks for nothing; under load a burst test's
600 passes went by in 0.5 s that way while the leading read was still running
(issue 33, seed 5)."""

from __future__ import annotations

import types
from concurrent.futures import Future

import torch
from sglang_l3.patches.hicache.streamed_restore import Stream, lane_of
from sglang_l3.testing.stream_landing import copies_completed, landing_futures


def _piece(first: int, done: bool) -> types.SimpleNamespace:
    """A piece in flight as the lane holds it (first page, pages, its read's future)."""
    f: Future = Future()
    if done:
        f.set_result(2)
    return types.SimpleNamespace(first_page=first, pages=2, future=f)


def test_only_the_leading_read_of_each_stream_wakes_the_loop() -> None:
    pipe = types.SimpleNamespace()
    lane = lane_of(pipe)
    rows = torch.zeros(0, dtype=torch.int64)
    a = Stream(handle="A", op=None, start=0, hit=0, rows=rows, rows_host=None, keys=[], prefix_keys=None, piece_pages=2)
    b = Stream(handle="B", op=None, start=0, hit=0, rows=rows, rows_host=None, keys=[], prefix_keys=None, piece_pages=2)
    idle = Stream(
        handle="C", op=None, start=0, hit=0, rows=rows, rows_host=None, keys=[], prefix_keys=None, piece_pages=2
    )
    a.pieces.extend([_piece(24, done=False), _piece(26, done=True)])  # the later read finished first
    b.pieces.append(_piece(4, done=True))
    lane.streams.update({"A": a, "B": b, "C": idle})
    assert landing_futures(pipe) == [a.pieces[0].future, b.pieces[0].future]
    del lane.streams["B"]
    got = landing_futures(pipe)
    assert got == [a.pieces[0].future] and not any(f.done() for f in got), "only A's leading read, still running"
    assert landing_futures(types.SimpleNamespace()) == []


class _Event:
    """A copy's completion event as the lane polls it (`query`)."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_completed_copy_wakes_the_loop_at_once(monkeypatch) -> None:
    """Upstream's loop ticks again at once while a prefetch is in progress, so a copy's
    freed host slots take the next read beside the one in flight. The stand-in used to
    sleep until the next piece landed (restore_bench at 131K, 1/16 buffer: one read in
    flight at a time after the first two, 1.66 s against 1.46 s)."""
    from sglang_l3.testing import stack

    pipe = types.SimpleNamespace()
    lane = lane_of(pipe)
    rows = torch.zeros(0, dtype=torch.int64)
    a = Stream(handle="A", op=None, start=0, hit=0, rows=rows, rows_host=None, keys=[], prefix_keys=None, piece_pages=2)
    a.pieces.append(_piece(4, done=False))  # the next piece is still being read
    copy = types.SimpleNamespace(first_page=2, pages=2, copied=_Event(False))
    a.copying.append(copy)
    lane.streams["A"] = a
    assert not copies_completed(pipe), "the copy is still running"
    assert not copies_completed(types.SimpleNamespace())

    waited: list[float] = []
    monkeypatch.setattr(stack, "futures_wait", lambda fs, timeout, return_when: waited.append(timeout))
    cache = types.SimpleNamespace(buffer_pipeline=pipe)
    stack.wait_for_work(cache)
    assert waited == [stack.STREAM_WAIT_S], "nothing to free: it waits for the leading read"

    copy.copied.done = True
    assert copies_completed(pipe)
    stack.wait_for_work(cache)
    assert waited == [stack.STREAM_WAIT_S], "a completed copy's slots are freed by the next tick, now"

    a.copying.clear()
    lane.retiring.append(types.SimpleNamespace(copied=_Event(True), host=None, rows=None))  # an ended stream's copy
    assert copies_completed(pipe)
    lane.retiring[0].copied.done = False
    assert not copies_completed(pipe)
