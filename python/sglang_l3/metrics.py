"""Process-wide counters for sglang-l3 (restores, re-anchors, fallbacks, store events).

Cheap, lock-protected integers keyed by name (and an optional label such as a
fallback reason). `snapshot()` feeds `sglang-l3 doctor --stats`; when
prometheus_client is importable and SGLang metrics are enabled, the same
counters are exported as `sglang_l3_<name>_total{reason=...}`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import threading
import time
from collections import Counter
from typing import Optional

_LOCK = threading.Lock()
_COUNTS: Counter[str] = Counter()
_PROM: dict[str, object] = {}
_LAST_PUBLISH = [0.0]
PUBLISH_INTERVAL_S = 1.0


def stats_dir() -> str:
    """Where serving processes publish their counters for `doctor --stats`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("SGLANG_L3_STATS_DIR") or os.path.join(base, "sglang-l3", "stats")


def _key(name: str, label: Optional[str]) -> str:
    return f"{name}{{{label}}}" if label else name


def inc(name: str, label: Optional[str] = None, n: int = 1) -> None:
    with _LOCK:
        _COUNTS[_key(name, label)] += n
    _prom_inc(name, label, n)
    _maybe_publish()


def _maybe_publish(force: bool = False) -> None:
    # Only serving processes publish (the plugin sets SGLANG_L3_PUBLISH_STATS);
    # tests and tools keep their counters in memory.
    if os.environ.get("SGLANG_L3_PUBLISH_STATS") != "1":
        return
    now = time.monotonic()
    if not force and now - _LAST_PUBLISH[0] < PUBLISH_INTERVAL_S:
        return
    _LAST_PUBLISH[0] = now
    try:
        d = stats_dir()
        os.makedirs(d, mode=0o700, exist_ok=True)
        path = os.path.join(d, f"{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "time": time.time(), "counters": snapshot()}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # counters are best-effort; never disturb serving


def collect_published() -> dict[str, int]:
    """Sum the counters published by live sglang-l3 processes on this machine."""
    total: Counter[str] = Counter()
    for path in glob.glob(os.path.join(stats_dir(), "*.json")):
        try:
            with open(path) as f:
                data = json.load(f)
            os.kill(int(data["pid"]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.remove(path)  # a finished server's counters
            continue
        except (OSError, ValueError, KeyError):
            continue
        total.update(data.get("counters", {}))
    return dict(total)


def get(name: str, label: Optional[str] = None) -> int:
    with _LOCK:
        return _COUNTS[_key(name, label)]


def snapshot() -> dict[str, int]:
    with _LOCK:
        return dict(_COUNTS)


def reset() -> None:
    with _LOCK:
        _COUNTS.clear()


def _prom_inc(name: str, label: Optional[str], n: int) -> None:
    try:
        from prometheus_client import Counter as PromCounter
    except ImportError:
        return
    metric = _PROM.get(name)
    if metric is None:
        try:
            metric = PromCounter(f"sglang_l3_{name}", f"sglang-l3 {name.replace('_', ' ')}", ["reason"])
        except ValueError:  # already registered in this process under another object
            return
        _PROM[name] = metric
    metric.labels(reason=label or "").inc(n)  # type: ignore[attr-defined]
