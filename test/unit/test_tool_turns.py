"""sglang_l3.sessions.turn_pairs: an answer that ended in a tool call is paired with its
turn's session whichever is known first, and read from the streamed chunk that
ends the answer."""

from __future__ import annotations

from sglang_l3.sessions.turn_pairs import MAX_RECENT, TurnPairs, tool_call_rid


def test_a_turn_that_finished_first_is_named_by_its_tool_call():
    p = TurnPairs()
    assert p.finished("r1", "s") is False
    assert p.tool_call("r1") == "s"
    assert not p.recent and not p.awaiting  # paired: nothing left to remember


def test_a_tool_call_seen_before_the_turn_finished_pairs_at_the_finish():
    p = TurnPairs()
    assert p.tool_call("r1") is None  # a whole answer is parsed before the turn's bookkeeping ends
    assert p.finished("r1", "s") is True
    assert p.finished("r2", "s") is False  # an answer without a tool call


def test_both_memories_are_bounded():
    p = TurnPairs()
    for i in range(MAX_RECENT + 5):
        p.finished(f"f{i}", "s")
        p.tool_call(f"t{i}")
    assert len(p.recent) == MAX_RECENT and len(p.awaiting) == MAX_RECENT
    assert p.tool_call("f0") is None  # forgotten: the oldest went first
    assert p.tool_call(f"f{MAX_RECENT + 4}") == "s"


def test_a_streamed_chunk_that_ends_in_tool_calls_names_its_request():
    end = 'data: {"id":"abc","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\n'
    mid = 'data: {"id":"abc","choices":[{"index":0,"delta":{"tool_calls":[{"id":"t"}]},"finish_reason":null}]}\n\n'
    assert tool_call_rid(end) == "abc"
    assert tool_call_rid(mid) is None
    assert tool_call_rid("data: [DONE]\n\n") is None
    assert tool_call_rid('data: {"id": 5, "choices": [{"finish_reason": "tool_calls"}]}') is None
    assert tool_call_rid("data: {not json tool_calls") is None


def test_no_tool_turn_message_while_the_scheduler_side_is_not_applied(monkeypatch):
    """Issue 49: with SGLANG_L3_DISABLE=tool-call-turns the HTTP side still sent its
    RpcReqInput on every tool-calling turn; no scheduler hook took it out, so upstream's
    dispatcher answered each with an error and a TP barrier."""
    from types import SimpleNamespace

    from sglang_l3.sessions import pin_book, turn_pairs

    sent = []
    tm = SimpleNamespace(server_args=SimpleNamespace(dp_size=1), _dispatch_to_scheduler=sent.append)
    monkeypatch.setattr(pin_book, "on_tool_turn", lambda *a: None)
    monkeypatch.setattr(turn_pairs, "PAIRS", TurnPairs())
    for placed, rid in ((False, "off"), (True, "on")):
        monkeypatch.setattr(turn_pairs, "_PLACED", placed, raising=False)
        turn_pairs.on_finished(tm, rid, f"s-{rid}")
        turn_pairs.on_tool_call(tm, rid)
    assert [m.parameters for m in sent] == [{"session": "s-on"}]
