"""Pages queued for the store and not yet written: a lookup of one waits for its write.

In buffer-only mode a node may leave the device as soon as its pages are staged on
the host; their L3 write is still queued or running. A request that arrives then and
looks the pages up would find nothing, and recompute what the store holds a moment
later (two agents on a small pool: the other agent's admission evicts this agent's
last turn right after it was staged). The controller notes each storage write when
it is queued and when its backup ends (patch `lookup-waits-write`); a lookup of a
noted page waits for that, bounded, then answers from the disk as before.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable

# (pool, page key)
Page = tuple[str, str]


class PendingWrites:
    """Counts of queued writes per page; a condition wakes the waiting lookups."""

    def __init__(self) -> None:
        self._n: Counter[Page] = Counter()
        self._cv = threading.Condition()

    def add(self, pages: Iterable[Page]) -> None:
        with self._cv:
            self._n.update(pages)

    def remove(self, pages: Iterable[Page]) -> None:
        with self._cv:
            for p in pages:
                left = self._n.get(p, 0) - 1
                if left > 0:
                    self._n[p] = left
                else:
                    self._n.pop(p, None)
            self._cv.notify_all()

    def clear(self) -> None:
        with self._cv:
            self._n.clear()
            self._cv.notify_all()

    def __len__(self) -> int:
        with self._cv:
            return len(self._n)

    def wait(self, pages: Iterable[Page], timeout: float) -> bool | None:
        """Block until none of `pages` is queued; None when none was (no wait), else
        whether they all finished within `timeout` seconds."""
        want = list(pages)
        deadline = time.monotonic() + timeout
        with self._cv:
            if not any(p in self._n for p in want):
                return None
            while any(p in self._n for p in want):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True
