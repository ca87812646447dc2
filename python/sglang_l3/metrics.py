"""Process-wide counters for sglang-l3 (restores, re-anchors, fallbacks, store events).

Cheap, lock-protected integers keyed by name (and an optional label such as a
fallback reason). `snapshot()` feeds `sglang-l3 doctor --stats`; when
prometheus_client is importable and SGLang metrics are enabled, the same
counters are exported as `sglang_l3_<name>_total{reason=...}`.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Optional

_LOCK = threading.Lock()
_COUNTS: Counter[str] = Counter()
_PROM: dict[str, object] = {}


def _key(name: str, label: Optional[str]) -> str:
    return f"{name}{{{label}}}" if label else name


def inc(name: str, label: Optional[str] = None, n: int = 1) -> None:
    with _LOCK:
        _COUNTS[_key(name, label)] += n
    _prom_inc(name, label, n)


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
