"""Patch `tool-call-turns`: a turn that ends in a tool call marks its session as a
conversation from its first turn (issue 31 items 2 and 5).

An implicit session ranks with closed sessions in L3 until its second turn, so a
one-off prompt is not protected like a conversation; but an agent's first call
that ends in a tool call is a conversation already, and ranked as a one-off its
context went to the evictor beside every stray prompt's before the agent came
back.

HTTP process: AROUND `OpenAIServingChat._generate_chat_stream` (streamed
answers: the chunk whose `finish_reason` is "tool_calls") and AFTER
`OpenAIServingChat._build_chat_response` (whole answers) it learns that an answer
ended in a tool call (the server's tool-call parser found one);
sglang_l3.sessions.turn_pairs pairs it with the turn's implicit session and sends the
scheduler ranks one upstream `RpcReqInput` message (and lets tool pins decide).

Scheduler ranks: AROUND `Scheduler.process_input_requests` the messages are taken
out of the received list (every TP rank receives the same list, broadcast by
rank 0) before upstream sees the rest, and the store's session registry counts
the session's tool-call turn (`SessionRetention.on_tool_call`), which ranks it as
an open session from then on. Placement only: no token changes.
Counter: `session_tool_turns`.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_l3.patches.framework import PatchContext
from sglang_l3.patches.sessions.sessions import registry_of
from sglang_l3.sessions import rpc

logger = logging.getLogger("sglang_l3.tool_turns")

SCHED = "sglang.srt.managers.scheduler:Scheduler"
CHAT = "sglang.srt.entrypoints.openai.serving_chat:OpenAIServingChat"


def apply_message(registry: Any, params: dict[str, Any]) -> None:
    if registry is not None:
        registry.on_tool_call(str(params.get("session")))


def _process_input_requests(original: Any, sched: Any, recv_reqs: Any, *args: Any, **kwargs: Any) -> Any:
    if recv_reqs:  # the registry is looked up only when a message of ours is there (most iterations have none)
        recv_reqs = rpc.take(
            recv_reqs, rpc.TOOL_TURN, lambda params: apply_message(registry_of(sched.tree_cache), params), "tool turn"
        )
    return original(sched, recv_reqs, *args, **kwargs)


def _tool_call(serving: Any, rid: str) -> None:
    from sglang_l3.sessions.turn_pairs import on_tool_call

    try:
        on_tool_call(serving.tokenizer_manager, rid)
    except Exception:  # placement only: never fail an answer
        logger.exception("sglang-l3 tool turns: cannot record the tool call of %s", rid)


def _generate_chat_stream(original: Any, serving: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang_l3.sessions.turn_pairs import tool_call_rid

    async def run() -> Any:
        async for chunk in original(serving, *args, **kwargs):
            rid = tool_call_rid(chunk)
            if rid is not None:
                _tool_call(serving, rid)
            yield chunk

    return run()


def _after_build_chat_response(result: Any, serving: Any, *args: Any, **kwargs: Any) -> None:
    choices = getattr(result, "choices", None)
    rid = getattr(result, "id", None)
    if isinstance(rid, str) and choices and any(getattr(c, "finish_reason", None) == "tool_calls" for c in choices):
        _tool_call(serving, rid)


def apply(ctx: PatchContext) -> None:
    from sglang_l3.sessions import turn_pairs

    ctx.around(f"{SCHED}.process_input_requests", _process_input_requests)
    ctx.around(f"{CHAT}._generate_chat_stream", _generate_chat_stream)
    ctx.after(f"{CHAT}._build_chat_response", _after_build_chat_response)
    # the HTTP side sends tool-turn messages only while this (scheduler) side is applied
    turn_pairs.set_placed(True)
    ctx.on_undo(lambda: turn_pairs.set_placed(False))
