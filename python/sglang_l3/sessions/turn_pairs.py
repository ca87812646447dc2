"""Turns that end in a tool call, the HTTP side (issue 31 items 2 and 5).

An agent's turn that ends in a tool call is a conversation going on: the
tool's result comes back as the session's next request. Two facts meet here,
in either order:

- the answer to request rid ended in a tool call: the server's tool-call
  parser found one, so the answer's `finish_reason` is "tool_calls" (patch
  `tool-call-turns` reads it from the streamed chunk or the whole answer);
- rid was a turn of implicit session sid (patch `implicit-sessions`, when
  the request's bookkeeping ends: a whole answer is parsed before that, a
  streamed one after).

When both are known, the scheduler ranks are told (one upstream `RpcReqInput`
message; TP rank 0 broadcasts it with the requests, so every rank applies it
at the same point): the L3 registry then ranks the session as a conversation
from its first turn (storage/retention.py), where a one-off prompt ranks as a
closed session. Tool pins (sglang_l3.sessions.pin_book, opt-in) decide on the same
event whether to pin the context on the device.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

from sglang_l3.sessions import rpc

logger = logging.getLogger("sglang_l3.tool_turns")

MAX_RECENT = 4096  # finished turns (rid -> session) awaiting their parsed answer, and the reverse


class TurnPairs:
    """Pairs "rid finished as a turn of sid" with "rid's answer ended in a tool
    call", whichever comes first; both memories bounded (oldest forgotten)."""

    def __init__(self) -> None:
        self.recent: OrderedDict[str, str] = OrderedDict()  # finished rid -> session
        self.awaiting: OrderedDict[str, None] = OrderedDict()  # tool-call rids not yet finished

    def finished(self, rid: str, sid: str) -> bool:
        """rid, a turn of sid, finished; True when its tool call was already seen."""
        if rid in self.awaiting:
            del self.awaiting[rid]
            return True
        self.recent[rid] = sid
        while len(self.recent) > MAX_RECENT:
            self.recent.popitem(last=False)
        return False

    def tool_call(self, rid: str) -> str | None:
        """rid's answer ended in a tool call: its session, or None while its turn
        has not finished (then remembered until it does, see `finished`)."""
        sid = self.recent.pop(rid, None)
        if sid is None:
            self.awaiting[rid] = None
            while len(self.awaiting) > MAX_RECENT:
                self.awaiting.popitem(last=False)
        return sid


PAIRS = TurnPairs()


def single_rank(tm: Any) -> bool:
    """One data-parallel rank: with several, a message could reach another rank's
    scheduler than the turn's."""
    return int(getattr(getattr(tm, "server_args", None), "dp_size", 1) or 1) == 1


def tool_call_rid(chunk: Any) -> str | None:
    """The request id of a streamed chunk that ends a choice with tool calls."""
    if not isinstance(chunk, str) or "tool_calls" not in chunk or not chunk.startswith("data: "):
        return None
    try:
        body = json.loads(chunk[len("data: ") :])
    except ValueError:
        return None
    choices = body.get("choices") if isinstance(body, dict) else None
    if isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") == "tool_calls" for c in choices
    ):
        rid = body.get("id")
        return rid if isinstance(rid, str) else None
    return None


def on_finished(tm: Any, rid: str, sid: str) -> None:
    """rid, a turn of implicit session sid, finished (its output is known)."""
    if PAIRS.finished(rid, sid):
        _tool_turn(tm, rid, sid)


def on_tool_call(tm: Any, rid: str) -> None:
    """The answer to rid ended in a tool call."""
    sid = PAIRS.tool_call(rid)
    if sid is not None:
        _tool_turn(tm, rid, sid)


_PLACED = False


def set_placed(placed: bool) -> None:
    """Patch tool-call-turns: whether the scheduler side that takes tool-turn messages is
    applied. Without it a message would reach upstream's dispatcher (an error and a TP
    barrier each)."""
    global _PLACED
    _PLACED = placed


def _tool_turn(tm: Any, rid: str, sid: str) -> None:
    from sglang_l3.sessions import pin_book

    if not single_rank(tm):
        return
    if _PLACED:
        try:
            rpc.send(tm, rpc.TOOL_TURN, {"session": sid})  # tell the scheduler ranks
        except Exception:  # noqa: BLE001 - placement only: never fail an answer
            logger.exception("sglang-l3 tool turns: cannot tell the scheduler about %s", sid)
    pin_book.on_tool_turn(tm, rid, sid)


__all__ = [
    "MAX_RECENT",
    "PAIRS",
    "TurnPairs",
    "on_finished",
    "on_tool_call",
    "set_placed",
    "single_rank",
    "tool_call_rid",
]
