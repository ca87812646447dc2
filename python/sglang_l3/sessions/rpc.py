"""Our messages on upstream's scheduler request stream, in one place: the HTTP process
sends an upstream `RpcReqInput` whose method is one of ours (`send`; TP rank 0
broadcasts it with the requests, so every rank applies it at the same point), and each
scheduler rank takes ours out of its received requests before upstream sees them
(`take`, from an AROUND on `Scheduler.process_input_requests`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("sglang_l3.sessions.rpc")

TOOL_TURN = "sglang_l3_tool_turn"  # a turn of an implicit session ended in a tool call (turn_pairs)
TOOL_PIN = "sglang_l3_tool_pin"  # pin / unpin a session's context on the device (pin_book)
METHODS = (TOOL_TURN, TOOL_PIN)


def send(tm: Any, method: str, parameters: dict[str, Any]) -> None:
    """One message of ours from the tokenizer manager `tm` to the scheduler ranks."""
    from sglang.srt.managers.io_struct import RpcReqInput

    if method not in METHODS:
        raise ValueError(f"sglang-l3: unknown scheduler message {method!r} (ours: {', '.join(METHODS)})")
    tm._dispatch_to_scheduler(RpcReqInput(method=method, parameters=parameters))


def take(recv_reqs: list, method: str, apply: Callable[[dict[str, Any]], None], what: str) -> list:
    """Apply our `RpcReqInput` messages of `method` among recv_reqs, in order, and
    return the rest, in order (upstream never sees ours)."""
    from sglang.srt.managers.io_struct import RpcReqInput

    def ours(r: Any) -> bool:
        return isinstance(r, RpcReqInput) and r.method == method

    if not any(ours(r) for r in recv_reqs):
        return recv_reqs
    rest = []
    for r in recv_reqs:
        if not ours(r):
            rest.append(r)
            continue
        try:
            apply(dict(r.parameters or {}))
        except Exception:  # placement only: never take the scheduler down
            logger.exception("sglang-l3 %s: cannot apply %s", what, r.parameters)
    return rest
