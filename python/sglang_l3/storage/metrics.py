"""Process-wide store counters (for /metrics, `doctor`, tests).

`counters()` sums every live PageStore in this process (one per TP rank
process; tests may hold several).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter as _Counter
from typing import Any

_STORES: "weakref.WeakSet[Any]" = weakref.WeakSet()
_LOCK = threading.Lock()


class Counters:
    def __init__(self) -> None:
        self._c: _Counter[str] = _Counter()
        self._lock = threading.Lock()

    def inc(self, name: str, n: int | float = 1) -> None:
        with self._lock:
            self._c[name] += n

    def get(self, name: str) -> int | float:
        with self._lock:
            return self._c.get(name, 0)

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._c)


def register(store: Any) -> None:
    with _LOCK:
        _STORES.add(store)


def counters() -> dict[str, int | float]:
    """Sum of all live stores' counters in this process."""
    total: _Counter[str] = _Counter()
    with _LOCK:
        stores = list(_STORES)
    for s in stores:
        total.update(s.counters.snapshot())
    return dict(total)
