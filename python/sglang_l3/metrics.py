"""The one counter path of sglang-l3: every counter (restores, re-anchors,
fallbacks, branch backups, store IO, ...) goes through `inc(name, label)`.

- `get` / `snapshot` / `reset`: this process's counters (tests, `doctor`).
- Prometheus: when SGLang metrics are enabled (`--enable-metrics` makes SGLang
  set PROMETHEUS_MULTIPROC_DIR before it starts its workers), every counter is
  also `sglang_l3_<name>_total{reason=<label>}` at SGLang's `/metrics`, summed
  over the worker processes (TP ranks) by prometheus_client's multiprocess mode.
- Published snapshot: a serving process (SGLANG_L3_PUBLISH_STATS=1, set by the
  plugin) writes its counters to SGLANG_L3_STATS_DIR/<pid>.json for
  `sglang-l3 doctor --stats`; a file whose process is gone (or whose pid now
  belongs to another process) is dropped when read.
- `Counters`: a per-object view (one L3 store) whose increments also go through
  `inc` as `store_<name>`; `store_counters()` is this process's store total.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

_LOCK = threading.Lock()
_COUNTS: dict[str, int | float] = {}  # not a Counter: values are also float (seconds)
_PROM: dict[str, Any] = {}  # prometheus_client counters (an optional, untyped import)
_LAST_PUBLISH = [0.0]
_TIMER: list[threading.Timer | None] = [None]
# One publish at a time: a snapshot taken earlier must never replace a newer one (threads
# that count, e.g. the store's IO threads, publish beside the scheduler's).
_PUBLISH_LOCK = threading.Lock()
PUBLISH_INTERVAL_S = 1.0
PROM_PREFIX = "sglang_l3_"
STORE_PREFIX = "store_"


def stats_dir() -> str:
    """Where serving processes publish their counters for `doctor --stats`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("SGLANG_L3_STATS_DIR") or os.path.join(base, "sglang-l3", "stats")  # envs.VARS


def _key(name: str, label: str | None) -> str:
    return f"{name}{{{label}}}" if label else name


def inc(name: str, label: str | None = None, n: int | float = 1) -> None:
    with _LOCK:
        k = _key(name, label)
        _COUNTS[k] = _COUNTS.get(k, 0) + n
    _prom_inc(name, label, n)
    _maybe_publish()


def get(name: str, label: str | None = None) -> int | float:
    with _LOCK:
        return _COUNTS.get(_key(name, label), 0)


def snapshot() -> dict[str, int | float]:
    with _LOCK:
        return dict(_COUNTS)


def reset() -> None:
    with _LOCK:
        _COUNTS.clear()


# --------------------------------------------------------------------------- #
# Per-object views (the L3 store)
# --------------------------------------------------------------------------- #
class Counters:
    """One object's counters; every increment also reaches `inc(prefix + name)`."""

    def __init__(self, prefix: str = STORE_PREFIX) -> None:
        self._c: dict[str, int | float] = {}
        self._lock = threading.Lock()
        self._prefix = prefix

    def inc(self, name: str, n: int | float = 1) -> None:
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n
        inc(self._prefix + name, None, n)

    def add(self, counts: Mapping[str, int | float]) -> None:
        """Several counters at once (a batch's totals); zeros are skipped, as a name
        never incremented stays absent."""
        for name, n in counts.items():
            if n:
                self.inc(name, n)

    def get(self, name: str) -> int | float:
        with self._lock:
            return self._c.get(name, 0)

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._c)


def store_counters() -> dict[str, int | float]:
    """This process's store counters (every store it opened), without the prefix."""
    return {k[len(STORE_PREFIX) :]: v for k, v in snapshot().items() if k.startswith(STORE_PREFIX)}


# --------------------------------------------------------------------------- #
# Prometheus (SGLang's /metrics)
# --------------------------------------------------------------------------- #
def prometheus_enabled() -> bool:
    """SGLang exports metrics: --enable-metrics set PROMETHEUS_MULTIPROC_DIR."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def _prom_inc(name: str, label: str | None, n: int | float) -> None:
    if not prometheus_enabled():
        return
    try:
        from prometheus_client import Counter as PromCounter
    except ImportError:
        return
    with _LOCK:
        metric = _PROM.get(name)
        if metric is None:
            try:
                metric = PromCounter(f"{PROM_PREFIX}{name}", f"sglang-l3 {name.replace('_', ' ')}", ["reason"])
            except ValueError:  # registered in this process under another object
                return
            _PROM[name] = metric
    metric.labels(reason=label or "").inc(n)


# --------------------------------------------------------------------------- #
# Published snapshots (`sglang-l3 doctor --stats`)
# --------------------------------------------------------------------------- #
def _start_time(pid: int) -> float | None:
    """When process `pid` started (None: no such process / unknown)."""
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except ImportError:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return float(f.read().rsplit(")", 1)[1].split()[19])  # starttime, clock ticks
        except (OSError, IndexError, ValueError):
            return None
    except Exception:  # psutil.NoSuchProcess, AccessDenied
        return None


def _publish() -> None:
    _LAST_PUBLISH[0] = time.monotonic()
    with _PUBLISH_LOCK:
        try:
            d = stats_dir()
            os.makedirs(d, mode=0o700, exist_ok=True)
            pid = os.getpid()
            path = os.path.join(d, f"{pid}.json")
            tmp = f"{path}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"pid": pid, "started": _start_time(pid), "time": time.time(), "counters": snapshot()}, f)
            os.replace(tmp, path)
        except OSError:
            pass  # counters are best-effort; never disturb serving


def _deferred_publish() -> None:
    with _LOCK:
        _TIMER[0] = None
    _publish()


def _maybe_publish(force: bool = False) -> None:
    # Only serving processes publish (the plugin sets SGLANG_L3_PUBLISH_STATS);
    # tests and tools keep their counters in memory.
    if os.environ.get("SGLANG_L3_PUBLISH_STATS") != "1":
        return
    if force or time.monotonic() - _LAST_PUBLISH[0] >= PUBLISH_INTERVAL_S:
        _publish()
        return
    # Too soon: publish once the interval has passed, so the last increments of a
    # burst are not held back until the next one.
    with _LOCK:
        if _TIMER[0] is not None:
            return
        timer = threading.Timer(PUBLISH_INTERVAL_S, _deferred_publish)
        timer.daemon = True
        _TIMER[0] = timer
    timer.start()


def publish_now() -> None:
    _maybe_publish(force=True)


def collect_published(exclude_pid: int | None = None) -> dict[str, int | float]:
    """Sum the counters published by live sglang-l3 processes on this machine.

    A file is dropped (and removed) when its process has exited or its pid now
    belongs to a process that started at another time (a reused pid)."""
    total: Counter[str] = Counter()
    for path in glob.glob(os.path.join(stats_dir(), "*.json")):
        try:
            with open(path) as f:
                data = json.load(f)
            pid = int(data["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid == exclude_pid:
            continue
        started = _start_time(pid)
        recorded = data.get("started")
        alive = started is not None and (recorded is None or abs(float(recorded) - started) < 1.0)
        if not alive:
            with contextlib.suppress(OSError):
                os.remove(path)  # a finished server's counters
            continue
        total.update(data.get("counters", {}))
    return dict(total)
