"""Predicted return: stage a session's context before it comes back (issue 31).

An agent's next call follows its last answer after a tool runs, a gap that
varies by turn but has a history. Per session (explicit or implicit, in the
HTTP process next to the hint book) this keeps the last gaps between a
turn's answer and the session's next request. A session is *due* once the
time since its last answer reaches the PERCENTILE-th percentile of its own
gaps (at least MIN_GAPS of them); a due session is staged once per idle
period with an ordinary "speaks next" hint of its last context (the hint
machinery: NVMe -> host -> device, the scheduler's guard decides what it
may replace, a context already on the device is a prefill-only no-op).

A wrong prediction costs at most that staging: the hint is a prefill-only
request that changes no answer, and a request arriving meanwhile joins it.
The clock is injected, so the rule is tested without sleeping.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_l3 import envs

MAX_SESSIONS = 4096
MAX_GAPS = 32  # gaps remembered per session (the most recent)
MIN_GAPS = 3  # no prediction before this many gaps
POOLED_GAPS = 256  # gaps of all sessions remembered (the most recent), for sessions with too few of their own


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100) of values, linear between ranks."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = (len(xs) - 1) * min(max(p, 0.0), 100.0) / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


ON_WORDS = ("1", "on", "true", "yes")  # the setting's documented default percentile
OFF_WORDS = ("", "off", "0", "false", "no")
DEFAULT_PREDICTED_RETURN = 25.0


def percentile_setting(name: str, default: float) -> float | None:
    """A percentile setting (e.g. SGLANG_L3_PREDICTED_RETURN): None when off
    (`off`, `0`, empty); `default` for `on` / `1` (so `1` is never the 1st
    percentile); a percentile as `pN` (any N in (0, 100], e.g. `p1`) or a plain
    number in (1, 100] (e.g. `90`). A bad value raises ValueError with the
    reason (start-up fails)."""
    raw = envs.value(name).strip().lower()
    if raw in OFF_WORDS:
        return None
    if raw in ON_WORDS:
        return default
    why = f"{name}={raw!r}: 'on', 'off', a percentile in (1, 100] (e.g. 90) or pN with N in (0, 100] (e.g. p1)"
    text, low = (raw[1:], 0.0) if raw.startswith("p") else (raw, 1.0)
    try:
        p = float(text)
    except ValueError as e:
        raise ValueError(why) from e
    if not low < p <= 100:
        raise ValueError(why)
    return p


def configured_percentile() -> float | None:
    """SGLANG_L3_PREDICTED_RETURN: the percentile, or None when off."""
    return percentile_setting("SGLANG_L3_PREDICTED_RETURN", DEFAULT_PREDICTED_RETURN)


@dataclass
class _Gaps:
    gaps: deque = field(default_factory=lambda: deque(maxlen=MAX_GAPS))
    answered: float | None = None  # when the last turn's answer came (None: a turn is running)
    running: int = 0  # requests of the session in flight
    staged: bool = False  # staged in this idle period


class ReturnPredictor:
    def __init__(self, pct: float = 25.0, now: Callable[[], float] = time.monotonic):
        self.pct = pct
        self._now = now
        self._sessions: OrderedDict[str, _Gaps] = OrderedDict()
        self.pooled: deque = deque(maxlen=POOLED_GAPS)  # every session's gaps, most recent last
        self.predicted = 0  # sessions staged by prediction
        self.returned_after_staging = 0  # ... whose request came while staged

    def _get(self, sid: str) -> _Gaps:
        g = self._sessions.pop(sid, None) or _Gaps()
        self._sessions[sid] = g
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return g

    def arrived(self, sid: str) -> None:
        """A request of sid arrived: the gap since its last answer is history."""
        g = self._get(sid)
        if g.answered is not None and g.running == 0:
            gap = max(0.0, self._now() - g.answered)
            g.gaps.append(gap)
            self.pooled.append(gap)
            if g.staged:
                self.returned_after_staging += 1
        g.running += 1
        g.answered, g.staged = None, False

    def answered(self, sid: str) -> None:
        """A request of sid finished (answer sent)."""
        g = self._get(sid)
        g.running = max(0, g.running - 1)
        if g.running == 0:
            g.answered = self._now()

    def expected_gap(self, sid: str) -> float | None:
        g = self._sessions.get(sid)
        if g is None or len(g.gaps) < MIN_GAPS:
            return None
        return percentile(list(g.gaps), self.pct)

    def gap_percentile(self, sid: str, pct: float) -> float | None:
        """The pct-th percentile of sid's own gaps, or of every session's recent gaps
        while sid has fewer than MIN_GAPS (a new agent of the same framework runs the
        same tools); None while neither has MIN_GAPS."""
        g = self._sessions.get(sid)
        if g is not None and len(g.gaps) >= MIN_GAPS:
            return percentile(list(g.gaps), pct)
        if len(self.pooled) >= MIN_GAPS:
            return percentile(list(self.pooled), pct)
        return None

    def due(self) -> list[str]:
        """Idle sessions whose predicted return has come, not yet staged;
        marks them staged (one staging per idle period)."""
        now, out = self._now(), []
        for sid, g in self._sessions.items():
            if g.running or g.staged or g.answered is None or len(g.gaps) < MIN_GAPS:
                continue
            if now - g.answered >= percentile(list(g.gaps), self.pct):
                g.staged = True
                out.append(sid)
        self.predicted += len(out)
        return out


__all__ = ["MIN_GAPS", "ReturnPredictor", "configured_percentile", "percentile"]
