"""Tool-call-aware retention, the HTTP side (issue 31 item 2).

An agent's turn that ends in a tool call comes back when the tool is done: a
gap with a history. Per session (implicit, sglang_l3.sessions.implicit) this
keeps the gaps between a turn's answer and the session's next request
(sglang_l3.sessions.return_prediction). When a turn ends in a tool call (the server's
tool-call parser found one: `finish_reason` "tool_calls"; sglang_l3.sessions.turn_pairs
pairs the answer with its session), its context is
*pinned* on the device for a TTL: the PERCENTILE-th percentile of the
session's own gaps (of every session's recent gaps while it has fewer than
MIN_GAPS; no pin while neither has), at most MAX_S seconds. The pin ends when
the session's next request arrives ("returned") or the TTL passes
("expired"), whichever is first.

This process only decides; the scheduler ranks place (patch `tool-pins`):
every pin and unpin travels to them as one message on the tokenizer ->
scheduler channel (upstream's `RpcReqInput`, intercepted before upstream's
dispatcher), which TP rank 0 broadcasts, so every rank applies it at the same
point of the same iteration. An unpin on return is sent before the request
itself. The clock is injected, so the rule is tested without sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sglang_l3 import envs, metrics
from sglang_l3.sessions import rpc
from sglang_l3.sessions.return_prediction import ReturnPredictor, percentile_setting

logger = logging.getLogger("sglang_l3.tool_pins")

PIN, RETURNED, EXPIRED = "pin", "returned", "expired"  # message ops (also counter labels)
MAX_PINS = 32  # pins held at once (the one expiring last gives way first: see patches/sessions/tool_pins.py)
ENV = "SGLANG_L3_TOOL_PIN"
ENV_MAX = "SGLANG_L3_TOOL_PIN_MAX_S"
DEFAULT_PERCENTILE = 90.0  # SGLANG_L3_TOOL_PIN=on (or 1)


def configured() -> tuple[float, float] | None:
    """(percentile, max TTL s) from SGLANG_L3_TOOL_PIN / _MAX_S, or None when off.
    A bad value raises ValueError with the reason (start-up fails)."""
    pct = percentile_setting(ENV, DEFAULT_PERCENTILE)
    if pct is None:
        return None
    raw_max = envs.value(ENV_MAX).strip()
    try:
        max_s = float(raw_max)
    except ValueError as e:
        raise ValueError(f"{ENV_MAX}={raw_max!r}: seconds > 0") from e
    if not max_s > 0:
        raise ValueError(f"{ENV_MAX}={raw_max!r}: seconds > 0")
    return pct, max_s


@dataclass
class Pin:
    rid: str
    expires: float  # the book's clock
    handle: Any = None  # the expiry timer (asyncio.TimerHandle)
    session: str = ""  # the pinned session


class PinBook:
    """Which sessions are pinned and until when; what to send is returned, not sent."""

    def __init__(self, pct: float, max_s: float, now: Callable[[], float] = time.monotonic):
        self.pct, self.max_s, self._now = pct, max_s, now
        self.gaps = ReturnPredictor(pct, now)
        self.pins: OrderedDict[str, Pin] = OrderedDict()  # session -> its pin

    def answered(self, sid: str) -> None:
        self.gaps.answered(sid)

    def arrived(self, sid: str) -> Pin | None:
        """A request of sid arrived: its gap is history; its pin (returned) if any."""
        self.gaps.arrived(sid)
        return self.pins.pop(sid, None)

    def ttl(self, sid: str) -> float | None:
        """How long sid's context stays pinned: None while there are no gaps to learn from."""
        ttl = self.gaps.gap_percentile(sid, self.pct)
        if ttl is None:
            metrics.inc("l3_tool_pin", "no_history")
            return None
        return min(ttl, self.max_s)

    def pin(self, sid: str, rid: str, ttl: float) -> tuple[Pin, list[Pin]]:
        """Pin sid for ttl s; returns (the pin, pins dropped to stay under MAX_PINS)."""
        old = self.pins.pop(sid, None)
        p = Pin(rid, self._now() + ttl, session=sid)
        self.pins[sid] = p
        dropped = [old] if old is not None else []
        while len(self.pins) > MAX_PINS:
            dropped.append(self.pins.popitem(last=False)[1])
        return p, dropped

    def expire(self, sid: str, rid: str) -> Pin | None:
        """sid's pin for rid, if it still stands (a later pin or a return replaced it)."""
        p = self.pins.get(sid)
        if p is None or p.rid != rid:
            return None
        return self.pins.pop(sid)


_BOOK: PinBook | None | Literal[False] = None  # False: looked up, off
# Patch tool-pins is applied in this process's patch set (it sets this in apply() and
# clears it on undo): the scheduler processes apply the same set, so without it no rank
# takes a pin message and each would cost an error and a TP barrier (SGLANG_L3_DISABLE=tool-pins).
_PLACED = False


def set_placed(placed: bool) -> None:
    """Patch tool-pins: whether the scheduler side that takes pin messages is applied."""
    global _PLACED
    _PLACED = placed


def book() -> PinBook | None:
    """The process's pin book; None when tool pins are off (or misconfigured:
    start-up fails on that in patch tool-pins; here it only logs), or when patch
    tool-pins is not applied (nothing would take the messages)."""
    global _BOOK
    if not _PLACED:
        return None
    if _BOOK is None:
        try:
            cfg = configured()
        except ValueError as e:
            logger.error("sglang-l3 tool pins off: %s", e)
            cfg = None
        _BOOK = PinBook(*cfg) if cfg is not None else False
    return _BOOK or None


def send_pin(tm: Any, op: str, sid: str, order_ms: int = 0) -> None:
    """One pin message (`rpc.TOOL_PIN`) to the scheduler ranks."""
    rpc.send(tm, rpc.TOOL_PIN, {"op": op, "session": sid, "order": order_ms})


def on_answer(sid: str) -> None:
    b = book()
    if b is not None:
        b.answered(sid)


def on_arrival(tm: Any, sid: str) -> None:
    """Before a request of sid is dispatched: its pin ends (sent ahead of it)."""
    b = book()
    if b is None:
        return
    p = b.arrived(sid)
    if p is not None:
        if p.handle is not None:
            p.handle.cancel()
        try:
            send_pin(tm, RETURNED, sid)
        except Exception:  # noqa: BLE001 - placement only: never fail the request
            logger.exception("sglang-l3 tool pin: cannot send the return of %s", sid)


def on_tool_turn(tm: Any, rid: str, sid: str) -> None:
    """rid, a turn of sid, ended in a tool call (sglang_l3.sessions.turn_pairs pairs the two)."""
    b = book()
    if b is not None:
        _pin(tm, b, rid, sid)


def _pin(tm: Any, b: PinBook, rid: str, sid: str) -> None:
    ttl = b.ttl(sid)
    if ttl is None:
        return
    p, dropped = b.pin(sid, rid, ttl)
    for old in dropped:
        if old.handle is not None:
            old.handle.cancel()
    # the pins dropped to stay under MAX_PINS end on the scheduler ranks too (sent ahead of
    # the new pin), so the two books never drift apart; a re-pin of sid replaces its own there
    for old in dropped:
        if old.session != sid:
            send_pin(tm, EXPIRED, old.session)
    # order: the pin's expiry on this process's clock, the same number on every rank
    send_pin(tm, PIN, sid, int(p.expires * 1000))
    p.handle = asyncio.get_running_loop().call_later(ttl, _expire, tm, sid, rid)
    logger.info("sglang-l3 tool pin: session %s pinned on the device for %.1f s", sid, ttl)


def _expire(tm: Any, sid: str, rid: str) -> None:
    b = book()
    if b is None or b.expire(sid, rid) is None:
        return
    try:
        send_pin(tm, EXPIRED, sid)
    except Exception:  # noqa: BLE001 - a lost unpin leaves the pin to the scheduler's cap
        logger.exception("sglang-l3 tool pin: cannot send the expiry of %s", sid)


__all__ = [
    "ENV",
    "ENV_MAX",
    "EXPIRED",
    "PIN",
    "RETURNED",
    "PinBook",
    "book",
    "configured",
    "on_answer",
    "on_arrival",
    "on_tool_turn",
    "send_pin",
]
