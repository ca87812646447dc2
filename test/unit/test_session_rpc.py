"""`sglang_l3.sessions.rpc`: our messages on upstream's scheduler request stream, sent
and taken in one place (patches tool-call-turns and tool-pins)."""

from __future__ import annotations

import types
from typing import Any

import pytest
from sglang.srt.managers.io_struct import RpcReqInput
from sglang_l3.sessions import rpc


def test_send_dispatches_one_of_ours_and_refuses_others() -> None:
    sent: list[Any] = []
    tm = types.SimpleNamespace(_dispatch_to_scheduler=sent.append)
    rpc.send(tm, rpc.TOOL_TURN, {"session": "s"})
    assert [(m.method, m.parameters) for m in sent] == [(rpc.TOOL_TURN, {"session": "s"})]
    with pytest.raises(ValueError, match="unknown scheduler message"):
        rpc.send(tm, "sglang_l3_typo", {})
    assert len(sent) == 1


def test_take_applies_ours_in_order_and_keeps_the_rest() -> None:
    other = RpcReqInput(method="upstream_thing", parameters={})
    reqs = [
        RpcReqInput(method=rpc.TOOL_PIN, parameters={"op": "pin", "session": "a"}),
        other,
        RpcReqInput(method=rpc.TOOL_TURN, parameters={"session": "b"}),
        RpcReqInput(method=rpc.TOOL_PIN, parameters={"op": "returned", "session": "a"}),
    ]
    seen: list[dict[str, Any]] = []
    rest = rpc.take(reqs, rpc.TOOL_PIN, seen.append, "tool pin")
    assert [p["op"] for p in seen] == ["pin", "returned"]
    assert rest == [other, reqs[2]]

    def boom(params: dict[str, Any]) -> None:
        raise RuntimeError("placement only")

    assert rpc.take(rest, rpc.TOOL_TURN, boom, "tool turn") == [other]  # logged, never raised
    assert rpc.take([other], rpc.TOOL_TURN, boom, "tool turn") == [other]
