"""How much slower this machine runs now than the quiet reference machine: the
factor test start-up and request timeouts are scaled by.

A fixed pure-Python CPU loop is timed by the wall clock. On the reference (the
2-vCPU development VM, AMD EPYC, nothing else running) it takes REFERENCE_S; a
slower CPU, and every runnable process beside it (two CPU hogs on two cores
about double it, load 20 makes it about ten times longer), make it longer in
proportion, as they do a server's start-up or a prefill. The factor is
max(1, wall / REFERENCE_S), at most MAX_FACTOR (a real hang still ends), and is
re-measured when older than REFRESH_S seconds, because the load on a shared
machine changes during a session. `SGLANG_L3_TEST_SLOWDOWN` fixes it instead
(e.g. 1 to turn scaling off).

Harness only: nothing a serving process imports uses this.
"""

from __future__ import annotations

import threading
import time

from sglang_l3 import envs

REFERENCE_S = 0.085  # wall seconds of _spin() on the quiet reference machine
LOOPS = 4_000_000
MAX_FACTOR = 20.0
REFRESH_S = 30.0
ENV = "SGLANG_L3_TEST_SLOWDOWN"

_lock = threading.Lock()
_last: tuple[float, float] | None = None  # (monotonic time measured, factor)


def _spin(n: int = LOOPS) -> int:
    x = 0
    for i in range(n):
        x += i & 7
    return x


def measure() -> float:
    """Time the loop once now: wall seconds / REFERENCE_S (unclamped)."""
    t0 = time.perf_counter()
    _spin()
    return (time.perf_counter() - t0) / REFERENCE_S


def slowdown(max_age: float = REFRESH_S) -> float:
    """The current factor (>= 1, <= MAX_FACTOR), measured at most `max_age` s ago."""
    global _last
    fixed = envs.value(ENV)
    if fixed:
        return max(float(fixed), 1e-3)
    now = time.monotonic()
    with _lock:
        if _last is not None and now - _last[0] < max_age:
            return _last[1]
    factor = min(MAX_FACTOR, max(1.0, measure()))
    with _lock:
        _last = (time.monotonic(), factor)
    return factor


def scaled(seconds: float) -> float:
    """`seconds` on the quiet reference machine, in this machine's seconds now."""
    return seconds * slowdown()


class Budget:
    """A time budget in reference-machine seconds, spent at the rate the machine
    runs: each wall second costs 1 / slowdown() of it (re-measured as it goes).
    `expired()` is checked in a polling loop; `spent_wall` and `factor` describe it."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = self._t = time.monotonic()
        self.spent = 0.0  # reference seconds
        self.factor = slowdown()
        self.max_factor = self.factor

    def _advance(self) -> None:
        now = time.monotonic()
        self.factor = slowdown()
        self.max_factor = max(self.max_factor, self.factor)
        self.spent += (now - self._t) / self.factor
        self._t = now

    def expired(self) -> bool:
        self._advance()
        return self.spent >= self.seconds

    @property
    def spent_wall(self) -> float:
        return time.monotonic() - self.start

    def describe(self) -> str:
        return (
            f"{self.spent_wall:.0f} s wall = {self.spent:.0f} of {self.seconds:.0f} s budgeted on the quiet "
            f"reference machine (measured slowdown now {self.factor:.1f}x, at most {self.max_factor:.1f}x; "
            f"load average {_loadavg()})"
        )


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"
