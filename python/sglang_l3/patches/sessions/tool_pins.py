"""Patch `tool-pins`: a turn that ends in a tool call keeps its context on the device
for a TTL learned from the session's own gaps (issue 31 item 2).

The HTTP side (sglang_l3.sessions.pin_book) decides: told by patch `tool-call-turns`
that a turn of an implicit session ended in a tool call, it sends the
scheduler ranks a pin, later an unpin (the session's next request, or the
TTL), as upstream `RpcReqInput` messages.

The scheduler side places: AROUND `Scheduler.process_input_requests` the pin
messages are taken out of the received list (every TP rank receives the same
list, broadcast by rank 0) and applied before upstream sees the rest. A pin
names a session; its context is the session's last finished context (patch
`session-guard` remembers it). Pins hold no lock: a pinned context stays
evictable, counted as evictable by admission, so it never makes a request wait
or fail. It is only evicted *last*: BEFORE `UnifiedRadixCache._evict` (every
device eviction, for prefill, decode, restores and hints alike) each pinned
context is touched once through upstream's own `touch_prefix` (the tree walk
of a match, without its finalizers), which moves its path to the
most-recently-used end of every component's LRU (both tree cores).
Under pressure the pins give way in a stated order, Belady's rule on the
predicted returns: the pin whose TTL ends furthest ahead is matched first, so
it is the least recent of the pinned and goes first; the pin about to be
needed goes last.

Counters (`l3_tool_pin{...}`): `pinned`; at the unpin, `hit` (the session
came back within its TTL and its context was still on the device), `expired`
(the TTL passed, context still there), `gave_way` (evicted while pinned);
`unknown` (no context remembered for the session: nothing pinned).

Same decision on every rank: the pin list changes only by broadcast messages
and the eviction walk is upstream's own; the touch is a walk of the same key
on the same tree. Active only with SGLANG_L3_TOOL_PIN on, the sglang-l3 file
store (session-guard's contexts) and one data-parallel rank.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext
from sglang_l3.patches.sessions.session_guard import contexts_of
from sglang_l3.sessions import rpc
from sglang_l3.sessions.pin_book import EXPIRED, MAX_PINS, PIN, RETURNED

logger = logging.getLogger("sglang_l3.tool_pins")

SCHED = "sglang.srt.managers.scheduler:Scheduler"
CACHE = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"


@dataclass(frozen=True)
class PinnedContext:
    order: int  # the pin's expiry (ms, the HTTP process's clock): the larger gives way first
    key: Any  # RadixKey of the session's last finished context
    device_tokens: int  # its full-KV tokens on the device when pinned


_PINS: weakref.WeakKeyDictionary[Any, OrderedDict[str, PinnedContext]] = weakref.WeakKeyDictionary()
_TOUCHING: weakref.WeakSet[Any] = weakref.WeakSet()


def pins_of(cache: Any) -> OrderedDict[str, PinnedContext]:
    book = _PINS.get(cache)
    if book is None:
        book = _PINS[cache] = OrderedDict()
    return book


def device_tokens(cache: Any, key: Any) -> int:
    """Full-KV tokens of key on the device (upstream's read-only walk: no touch)."""
    return int(cache.tree_core.match_full_device_prefix(key)[0])


def _unpin(cache: Any, sid: str, reason: str) -> None:
    p = pins_of(cache).pop(sid, None)
    if p is None:
        return
    kept = p.device_tokens > 0 and device_tokens(cache, p.key) >= p.device_tokens
    label = ("hit" if reason == RETURNED else "expired") if kept else "gave_way"
    metrics.inc("l3_tool_pin", label)


def apply_message(cache: Any, params: dict[str, Any]) -> None:
    """Apply one pin message (the same on every rank, in the same order)."""

    op, sid = params.get("op"), str(params.get("session"))
    if op in (RETURNED, EXPIRED):
        _unpin(cache, sid, op)
        return
    if op != PIN:
        logger.warning("sglang-l3 tool pin: unknown op %r ignored", op)
        return
    ctx = contexts_of(cache).get(sid)
    if ctx is None:
        metrics.inc("l3_tool_pin", "unknown")
        return
    _unpin(cache, sid, EXPIRED)  # a second tool call before the return: the newer context
    key = ctx.radix_key()
    book = pins_of(cache)
    book[sid] = PinnedContext(int(params.get("order") or 0), key, device_tokens(cache, key))
    while len(book) > MAX_PINS:  # the HTTP side drops the same (oldest) pin
        book.popitem(last=False)
    metrics.inc("l3_tool_pin", "pinned")


def touch_pinned(cache: Any) -> None:
    """Make the pinned contexts the most recently used, the one to give way first
    touched first (least recent of them). Upstream's `touch_prefix`: the tree walk
    alone, not `match_prefix` (a request's match: session shortcut, finalizers
    that may evict, linker), so nothing re-enters eviction from inside it."""
    book = _PINS.get(cache)
    if not book or cache in _TOUCHING:
        return
    _TOUCHING.add(cache)
    try:
        for _, p in sorted(book.items(), key=lambda kv: (-kv[1].order, kv[0])):
            cache.touch_prefix(p.key)
    finally:
        _TOUCHING.discard(cache)


def take_pin_messages(cache: Any, recv_reqs: list) -> list:
    """Apply the pin messages among recv_reqs, in order; the rest, in order."""
    return rpc.take(recv_reqs, rpc.TOOL_PIN, lambda params: apply_message(cache, params), "tool pin")


def _process_input_requests(original: Any, sched: Any, recv_reqs: Any, *args: Any, **kwargs: Any) -> Any:
    if recv_reqs:
        recv_reqs = take_pin_messages(sched.tree_cache, recv_reqs)
    return original(sched, recv_reqs, *args, **kwargs)


def _before_evict(cache: Any, *args: Any, **kwargs: Any) -> None:
    try:
        touch_pinned(cache)
    except Exception:  # placement only: upstream's LRU order stands
        logger.exception("sglang-l3 tool pin: cannot order the pinned contexts")


def applicable() -> str | None:
    from sglang_l3.sessions.pin_book import configured

    if configured() is None:
        return "SGLANG_L3_TOOL_PIN is off"
    return None


def apply(ctx: PatchContext) -> None:
    from sglang_l3.sessions import pin_book

    ctx.around(f"{SCHED}.process_input_requests", _process_input_requests)
    ctx.before(f"{CACHE}._evict", _before_evict)
    # the HTTP side sends pin messages only while this (scheduler) side is applied
    pin_book.set_placed(True)
    ctx.on_undo(lambda: pin_book.set_placed(False))
