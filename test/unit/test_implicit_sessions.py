"""Issue 31, item 1: implicit sessions (no session_id from the client).

The tokenizer manager's decision (sglang_l3.sessions.implicit) on real L3
page-key chains (upstream's get_storage_hash_str), and the session registry's
own rule for implicit sessions (storage.retention): one-turn ones rank with
closed sessions and are reaped first, so the table stays bounded."""

from __future__ import annotations

import pytest
from sglang_l3 import metrics as l3_metrics
from sglang_l3.sessions.implicit import (
    INPUT_TAIL,
    MAX_SESSIONS,
    ImplicitSessions,
    end_pages,
    page_keys,
    prefix_digests,
    turn_end_points,
)
from sglang_l3.storage import retention
from sglang_l3.storage import sessions as table
from sglang_l3.storage.retention import CLOSED, MAX_IMPLICIT, OPEN, PLAIN, SessionRetention
from test_store_support import keys

PAGE = 16


def _toks(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


SYSTEM = _toks(1, 100)  # a system prompt of 6.25 pages


class _Turn:
    """One call of an agent: the tracker's decision, then its finish."""

    def __init__(self, t: ImplicitSessions, ids: list[int], out: list[int]):
        self.ids, self.out = ids, out
        self.sid, self.continued = t.decide(ids)
        t.finished(self.sid, turn_end_points(ids, ids + out, None, None))


def test_one_agents_calls_are_one_session_and_two_agents_are_two():
    t = ImplicitSessions()
    a_in = SYSTEM + _toks(2, 37)
    b_in = SYSTEM + _toks(3, 41)  # another agent: shares only the system prompt
    a1 = _Turn(t, a_in, _toks(4, 20))
    b1 = _Turn(t, b_in, _toks(5, 20))
    assert not a1.continued and not b1.continued and a1.sid != b1.sid
    assert a1.sid.startswith(table.IMPLICIT_PREFIX) and table.valid_session_id(a1.sid)
    # a's next call re-serialises its answer (diverges right after its input)
    a2 = _Turn(t, a_in + _toks(6, 25) + _toks(7, 60), _toks(8, 20))
    assert a2.continued and a2.sid == a1.sid
    # and the one after extends input + output exactly
    a3_in = a2.ids + a2.out + _toks(9, 30)
    a3 = _Turn(t, a3_in, _toks(10, 20))
    assert a3.continued and a3.sid == a1.sid
    # b's next call is b's, even though a's chain is longer
    b2 = _Turn(t, b_in + b1.out + _toks(11, 40), _toks(12, 20))
    assert b2.continued and b2.sid == b1.sid
    # a third agent with the same system prompt starts its own
    c1 = _Turn(t, SYSTEM + _toks(13, 50), _toks(14, 20))
    assert not c1.continued and c1.sid not in (a1.sid, b1.sid)
    assert len(t) == 3


# The real Qwen3.5 template's last tokens through the tiny model's tokenizer: the input
# ends with the generation prompt "...assistant\n<think>\n"; the next call renders that
# answer as "<think>\n\n</think>\n\n...": the input's last token ("\n", 198) becomes
# "\n\n" (312). Prompts of one call and the next, measured: 574 of 575 tokens shared.
GEN = [284, 83, 302, 83, 198, 1048, 198]
RERENDERED = [284, 83, 302, 83, 198, 1048, 312, 1049, 312]


def test_the_next_call_continues_when_the_template_rerenders_the_inputs_last_token():
    t = ImplicitSessions()
    a1 = _Turn(t, SYSTEM + _toks(2, 37) + GEN, _toks(3, 20))
    a2 = _Turn(t, SYSTEM + _toks(2, 37) + RERENDERED + _toks(4, 30) + GEN, _toks(5, 20))
    assert a2.continued and a2.sid == a1.sid
    # another agent that shares the system prompt and the first words of the message, and
    # the whole generation prompt, is still another session: the end point keeps the user's words
    b = _Turn(t, SYSTEM + _toks(2, 36) + [9] + GEN, _toks(6, 20))
    assert not b.continued and b.sid != a1.sid
    assert len(GEN) - 2 > INPUT_TAIL


@pytest.mark.parametrize("first", [1, 20, 60])
@pytest.mark.parametrize("page", [1, 64])
def test_two_agents_with_one_long_system_prompt_and_short_first_messages_are_two(page, first):
    """Issue 49: a 6,656-token system prompt (104 pages of 64) and first messages of 1,
    20 and 60 tokens: a page-aligned end point fell in the prompt's last page and merged
    the agents (B's tool call credited to A, A's next request unpinning B)."""
    t = ImplicitSessions()
    system = _toks(20, 104 * 64)
    a1 = _Turn(t, system + _toks(21, first) + GEN, _toks(22, 20))
    b1 = _Turn(t, system + _toks(23, first) + GEN, _toks(24, 20))
    assert not b1.continued and b1.sid != a1.sid
    # each continues its own
    b2 = _Turn(t, b1.ids[:-1] + RERENDERED + b1.out + _toks(25, 30) + GEN, _toks(26, 20))
    a2 = _Turn(t, a1.ids[:-1] + RERENDERED + a1.out + _toks(27, 30) + GEN, _toks(28, 20))
    assert (a2.continued, a2.sid, b2.continued, b2.sid) == (True, a1.sid, True, b1.sid)
    assert page_keys(a1.ids, page)[: len(system) // page] == page_keys(b1.ids, page)[: len(system) // page]


def test_an_identical_first_call_is_another_agent_not_a_continuation():
    """Two agents whose first calls are the same tokens ("fix the failing test" after one
    system prompt): the second extends nothing, so it starts its own session; their
    second calls (the template re-renders the input's end, so both extend only the input's
    end point) go one to each session, not both to the one that reached it last."""
    t = ImplicitSessions()
    first = SYSTEM + _toks(30, 6) + GEN
    a = _Turn(t, first, _toks(31, 20))
    b = _Turn(t, list(first), _toks(32, 20))
    assert not b.continued and b.sid != a.sid
    a2 = _Turn(t, a.ids[:-1] + RERENDERED + a.out + _toks(33, 50) + GEN, _toks(34, 20))
    b2 = _Turn(t, b.ids[:-1] + RERENDERED + b.out + _toks(35, 50) + GEN, _toks(36, 20))
    assert (a2.continued, b2.continued) == (True, True) and {a2.sid, b2.sid} == {a.sid, b.sid}


def _compacted(first: _Turn, summary: list[int]) -> list[int]:
    """Hermes after a compaction (measured, hermes-agent 0.19.0): the system prompt and
    the first message as before, then the summary instead of the middle of the history."""
    return first.ids[:-1] + RERENDERED + summary + GEN


def test_a_compacted_history_continues_its_session_and_not_the_other_agents():
    """Issue 49 item 7: after a compaction the agent's next prompt extends no end point
    of its latest turn, only its first turn's input (its root): the session continues
    (the table then demotes the old tail), and the other agent, whose prompt shares the
    system prompt, keeps its own."""
    t = ImplicitSessions()
    a1 = _Turn(t, SYSTEM + _toks(2, 9) + GEN, _toks(3, 20))
    b1 = _Turn(t, SYSTEM + _toks(4, 9) + GEN, _toks(5, 20))
    a2 = _Turn(t, a1.ids[:-1] + RERENDERED + a1.out + _toks(6, 300) + GEN, _toks(7, 20))
    b2 = _Turn(t, b1.ids[:-1] + RERENDERED + b1.out + _toks(8, 300) + GEN, _toks(9, 20))
    assert (a2.sid, b2.sid) == (a1.sid, b1.sid) and a1.sid != b1.sid
    before = l3_metrics.get("implicit_sessions", "rewritten")
    summary_a = _compacted(a1, _toks(10, 80))
    assert t.match(summary_a) is None, "a compacted prompt extends no latest end point"
    a3 = _Turn(t, summary_a, _toks(11, 20))
    assert a3.continued and a3.sid == a1.sid
    b3 = _Turn(t, _compacted(b1, _toks(12, 80)), _toks(13, 20))
    assert b3.continued and b3.sid == b1.sid
    assert l3_metrics.get("implicit_sessions", "rewritten") - before == 2
    # the next call after the compaction extends its latest end point as usual, and a
    # second compaction continues from the same root
    a4 = _Turn(t, a3.ids[:-1] + RERENDERED + a3.out + _toks(14, 30) + GEN, _toks(15, 20))
    a5 = _Turn(t, _compacted(a1, _toks(16, 90)), _toks(17, 20))
    assert a4.sid == a5.sid == a1.sid and len(t) == 2 and t.roots() == 2
    # a prompt that diverges inside the first message continues nothing
    assert t.match_root(SYSTEM + _toks(2, 5) + _toks(18, 40) + GEN) is None


def test_agents_with_identical_first_calls_do_not_continue_from_their_root():
    """Two agents whose first calls are the same tokens share a root: a compaction of
    either cannot tell whose it is, so it starts a new session (nothing merged); once
    the other is forgotten, the root is one session's again."""
    t = ImplicitSessions()
    first = SYSTEM + _toks(30, 6) + GEN
    a = _Turn(t, first, _toks(31, 20))
    b = _Turn(t, list(first), _toks(32, 20))
    a2 = _Turn(t, a.ids[:-1] + RERENDERED + a.out + _toks(33, 200) + GEN, _toks(34, 20))
    b2 = _Turn(t, b.ids[:-1] + RERENDERED + b.out + _toks(39, 200) + GEN, _toks(40, 20))
    assert a2.sid == a.sid != b.sid == b2.sid, "each agent's second call continues its own session"
    c = _Turn(t, _compacted(a, _toks(35, 60)), _toks(36, 20))
    assert not c.continued and c.sid not in (a.sid, b.sid)
    t.forget(b.sid)
    d = _Turn(t, _compacted(a, _toks(37, 60)), _toks(38, 20))
    assert d.continued and d.sid == a.sid


def test_prefix_digests_are_one_pass_and_namespaced():
    ids = _toks(40, 300)
    d = prefix_digests(ids, [300, 10, 150, 0, 301])
    assert sorted(d) == [10, 150, 300]
    assert d[150] == prefix_digests(ids[:150], [150])[150] != prefix_digests(ids, [150], extra_key="lora")[150]
    assert prefix_digests(ids, [150], cache_salt="s")[150] != d[150]
    assert prefix_digests(ids, [150], cache_salt="")[150] == d[150]  # an empty salt is no salt


def test_a_prompt_that_diverges_inside_the_earlier_input_starts_a_session():
    t = ImplicitSessions()
    a1 = _Turn(t, SYSTEM + _toks(2, 80), _toks(3, 20))
    edited = SYSTEM + _toks(2, 40) + _toks(4, 60)  # same start, history rewritten
    e = _Turn(t, edited, _toks(5, 20))
    assert not e.continued and e.sid != a1.sid
    # a prompt shorter than every end point continues nothing
    assert t.match(_toks(6, PAGE - 1)) is None


def test_keys_are_the_l3_chain_with_its_namespace():
    ids = _toks(2, 3 * PAGE + 5)
    ks = page_keys(ids, PAGE)
    assert len(ks) == 3 and ks == page_keys(ids[: 3 * PAGE], PAGE)
    assert page_keys(ids, PAGE, extra_key="lora-x") != ks
    assert page_keys(ids, PAGE, cache_salt="s")[0] != ks[0]


def test_the_tracker_stays_bounded_over_10000_one_off_requests():
    t = ImplicitSessions()
    a1 = _Turn(t, SYSTEM + _toks(2, 40), _toks(3, 20))
    a2 = _Turn(t, a1.ids + a1.out + _toks(4, 30), _toks(5, 20))
    assert a2.sid == a1.sid
    for i in range(10_000):
        one = _Turn(t, _toks(100 + i, 2 * PAGE + 3), [1, 2, 3])
        assert not one.continued
    assert len(t) <= MAX_SESSIONS and t.ends() <= 2 * MAX_SESSIONS and t.roots() <= MAX_SESSIONS
    a3 = _Turn(t, a2.ids + a2.out + _toks(6, 30), _toks(7, 20))
    assert a3.continued and a3.sid == a1.sid, "a conversation outlives one-off prompts"


def test_the_tracker_reloads_implicit_sessions_from_the_table():
    t = ImplicitSessions()
    a1 = _Turn(t, SYSTEM + _toks(2, 40), _toks(3, 20))
    full = page_keys(a1.ids + a1.out, PAGE)
    ends = [list(e) for e in turn_end_points(a1.ids, a1.ids + a1.out, None, None)]
    rec = table.SessionRecord(
        a1.sid,
        full,
        len(a1.ids) + 20,
        implicit=True,
        turns=1,
        input_pages=end_pages(len(a1.ids), PAGE),
        ends=ends,
        root=ends[0],
    )
    # through the table's encoding, as a restart reads it
    rec = table.decode(table.encode("m" * 16, [rec]), None)[1][0]
    old = table.SessionRecord(_implicit(7), full, 90, implicit=True, turns=1)  # written before end points
    explicit = table.SessionRecord("agent-x", page_keys(_toks(9, 64), PAGE), 64)
    t2 = ImplicitSessions()
    assert t2.load([rec, old, explicit]) == 1
    again = _Turn(t2, a1.ids + _toks(4, 50), _toks(5, 20))  # diverges after the input
    assert again.continued and again.sid == a1.sid
    assert t2.match(_toks(9, 64) + _toks(10, 20)) is None  # explicit sessions are not matched
    # the root came back too: a rewritten history continues after the restart
    assert t2.match_root(a1.ids[:-INPUT_TAIL] + _toks(11, 30)) == (a1.sid, len(a1.ids) - INPUT_TAIL)


def test_the_table_refuses_malformed_end_points():
    good = table.SessionRecord(_implicit(8), [], 9, implicit=True, ends=[[5, "0" * 32]])
    assert table.decode(table.encode("m" * 16, [good]), None)[1][0].ends == [[5, "0" * 32]]
    for bad in ([[0, "0" * 32]], [[5, "z" * 32]], [[5]], [[True, "0" * 32]], [[1, "0" * 32]] * 5):
        rec = table.SessionRecord(_implicit(8), [], 9, implicit=True, ends=bad)
        with pytest.raises(table.TableError, match="malformed"):
            table.decode(table.encode("m" * 16, [rec]), None)
    for bad_root in ([5], [[5, "0" * 32]], [0, "0" * 32], "x"):
        rec = table.SessionRecord(_implicit(8), [], 9, implicit=True, ends=[[5, "0" * 32]], root=bad_root)
        with pytest.raises(table.TableError, match="malformed"):
            table.decode(table.encode("m" * 16, [rec]), None)
    good.root = [5, "0" * 32]
    assert table.decode(table.encode("m" * 16, [good]), None)[1][0].root == [5, "0" * 32]


def test_the_registry_keeps_a_sessions_first_root():
    reg = SessionRetention(None, "m" * 16, writer=False)
    sid = _implicit(3)
    reg.on_turn(sid, keys(2, "r"), 8, finished=False)
    reg.on_turn(sid, keys(2, "r"), 9, root=[7, "1" * 32])
    reg.on_turn(sid, keys(3, "r"), 12, root=[11, "2" * 32])
    assert reg.get(sid).root == [7, "1" * 32]


# ------------------------------------------------------------ the registry
def _implicit(i: int) -> str:
    return f"{table.IMPLICIT_PREFIX}{i:032x}"


def _turn(reg: SessionRetention, sid: str, ks: list[str]) -> None:
    reg.on_turn(sid, ks[:-1] or ks, 4 * len(ks), finished=False)
    reg.on_turn(sid, ks, 4 * len(ks) + 2, input_pages=len(ks) - 1)


def test_one_turn_implicit_sessions_rank_as_closed_then_open():
    reg = SessionRetention(None, "m" * 16, writer=False)
    ks = keys(3, "a")
    sid = _implicit(1)
    _turn(reg, sid, ks)
    r = reg.get(sid)
    assert r.implicit and r.turns == 1 and r.open and r.input_pages == 2
    assert reg.class_of(ks[0]) == CLOSED
    _turn(reg, sid, ks + keys(1, "b"))
    assert reg.get(sid).turns == 2 and reg.class_of(ks[0]) == OPEN
    # explicit sessions are unchanged: open from the first turn
    reg.on_turn("agent-x", keys(2, "x"), 8)
    assert reg.class_of(keys(2, "x")[0]) == OPEN and not reg.get("agent-x").implicit


def test_the_table_reaps_one_off_implicit_sessions_over_10000_requests(tmp_path):
    from sglang_l3.storage.safety import StoreDirs

    mid = "0" * 16
    with StoreDirs(tmp_path / "store", create=True) as dirs:
        reg = SessionRetention(dirs, mid, writer=False)
        conv = _implicit(0)
        conv_keys = keys(4, "conv")
        _turn(reg, conv, conv_keys[:2])
        _turn(reg, conv, conv_keys)  # a conversation: two turns
        reg.on_turn("agent-x", keys(2, "x"), 8)  # an explicit session is never reaped
        before = l3_metrics.get("session_implicit_reaped")
        for i in range(1, 10_001):
            _turn(reg, _implicit(i), keys(2, f"one-{i}"))
        recs = reg.records()
        implicit = [r for r in recs if r.implicit]
        assert len(implicit) == MAX_IMPLICIT
        assert reg.get(conv) is not None and reg.get("agent-x") is not None
        assert (
            l3_metrics.get("session_implicit_reaped") - before == 10_000 + 1 - MAX_IMPLICIT
        )  # the conversation + 10,000 one-offs
        # the newest one-offs stay (least recently used reaped first); the reaped ones' pages are plain
        assert reg.get(_implicit(10_000)) is not None and reg.get(_implicit(1)) is None
        assert reg.class_of(keys(2, "one-1")[0]) == PLAIN
        assert reg.class_of(conv_keys[0]) == OPEN
        # persisted and reloaded: the same bounded table, the implicit fields kept
        reg.writer = True
        assert reg.flush()
        again = SessionRetention(dirs, mid, writer=False)
        assert len(again.records()) == len(recs)
        r = again.get(conv)
        assert r.implicit and r.turns == 2 and r.input_pages == 3 and r.keys == conv_keys
        _turn(again, _implicit(20_000), keys(2, "late"))
        assert again.get(conv) is not None and len([r for r in again.records() if r.implicit]) == MAX_IMPLICIT


def test_table_reads_records_written_before_the_implicit_fields():
    import hashlib
    import json

    body = json.dumps(
        {
            "format": table.FORMAT,
            "version": table.VERSION,
            "mid": "m",
            "sessions": [{"id": "a", "keys": keys(2), "tokens": 8, "priority": 0, "last_use": 1.0, "open": True}],
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    data = json.dumps({"sha256": hashlib.sha256(body).hexdigest()}).encode() + b"\n" + body
    (r,) = table.decode(data, "m")[1]
    assert not r.implicit and r.turns == 0 and r.input_pages == 0 and r.tool_calls == 0
    bad = table.SessionRecord("b", keys(1), 4, input_pages=2)
    with pytest.raises(table.TableError):
        table.decode(table.encode("m", [bad]), "m")


def test_cap_constants_agree():
    assert retention.MAX_IMPLICIT == MAX_SESSIONS


# ------------------------------------------------- the tokenizer-manager hooks
class _Args:
    def __init__(self, store, radix_sessions=False):
        self.hicache_storage_backend = "file"
        self.hicache_storage_backend_extra_config = f'{{"store_dir": "{store}"}}'
        self.page_size = PAGE
        self.enable_session_radix_cache = radix_sessions


class _TM:
    """Stands in for the TokenizerManager around the two hooked methods (the
    server test drives them through upstream's)."""

    def __init__(self, store, **kw):
        self.server_args = _Args(store, **kw)
        self.incremental_streaming_output = False


def _tokenized(tm, ids, rid, **obj_fields):
    from array import array

    from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
    from sglang_l3.patches.sessions import implicit_sessions as patch

    obj = GenerateReqInput(input_ids=list(ids), rid=rid, **obj_fields)
    tok = TokenizedGenerateReqInput(
        input_text=None,
        input_ids=array("q", ids),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=None,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        rid=rid,
        session_id=obj_fields.get("session_id"),
    )
    patch._after_tokenize(tok, tm, obj, None, list(ids), None, None, None)
    return obj, tok


def _answer(tm, obj, out_ids):
    """Run the generate_request hook over an upstream stand-in that answers out_ids."""
    import asyncio

    from sglang_l3.patches.sessions import implicit_sessions as patch

    async def original(tm_, obj_, request=None):
        yield {"output_ids": list(out_ids), "meta_info": {"finish_reason": {"type": "length"}}}

    async def main():
        return [o async for o in patch._generate_request(original, tm, obj)]

    return asyncio.run(main())


def test_the_hooks_name_conversations_and_leave_explicit_ones_alone(tmp_path):
    tm = _TM(tmp_path)
    a_in = SYSTEM + _toks(2, 37)
    obj, tok = _tokenized(tm, a_in, "r1")
    sid = tok.session_id
    assert table.is_implicit_id(sid) and obj.session_id is None  # the client's object is untouched
    _answer(tm, obj, _toks(3, 20))
    _, tok2 = _tokenized(tm, a_in + _toks(3, 20) + _toks(4, 30), "r2")
    assert tok2.session_id == sid, "the next call of the conversation"
    _, tok3 = _tokenized(tm, SYSTEM + _toks(5, 40), "r3")
    assert tok3.session_id not in (None, sid), "another agent with the same system prompt"
    _, explicit = _tokenized(tm, a_in + _toks(3, 20), "r4", session_id="agent-x")
    assert explicit.session_id == "agent-x", "an explicit session_id wins"
    _, hint = _tokenized(tm, a_in, "sglang-l3-hint-abc")
    assert hint.session_id is None
    _, short = _tokenized(tm, _toks(6, PAGE - 1), "r5")
    assert short.session_id is None


def test_the_hooks_are_off_with_the_session_radix_cache(tmp_path):
    tm = _TM(tmp_path, radix_sessions=True)
    _, tok = _tokenized(tm, SYSTEM + _toks(2, 37), "r1")
    assert tok.session_id is None


def test_after_a_restart_the_hooks_continue_a_persisted_conversation(tmp_path):
    from sglang_l3.storage.safety import StoreDirs

    tm = _TM(tmp_path)
    a_in = SYSTEM + _toks(2, 37)
    obj, tok = _tokenized(tm, a_in, "r1")
    _answer(tm, obj, _toks(3, 20))
    # what the scheduler's registry persists for that turn (patch sessions)
    with StoreDirs(tmp_path, create=True) as dirs:
        reg = SessionRetention(dirs, "0" * 16, writer=True)
        full = page_keys(a_in + _toks(3, 20), PAGE)
        ends = [list(e) for e in turn_end_points(a_in, a_in + _toks(3, 20), None, None)]
        reg.on_turn(tok.session_id, full, len(a_in) + 20, input_pages=len(a_in) // PAGE, ends=ends)
        assert reg.flush()
    restarted = _TM(tmp_path)  # a new tokenizer manager reads the table
    _, again = _tokenized(restarted, a_in + _toks(7, 30), "r2")  # diverges right after the input
    assert again.session_id == tok.session_id


def test_a_first_turn_that_ended_in_a_tool_call_ranks_as_a_conversation():
    """Patch tool-call-turns: an agent's first call that ended in a tool call is a
    conversation going on; a one-off prompt still ranks as closed."""
    reg = SessionRetention(None, "m" * 16, writer=False)
    agent, stray = _implicit(1), _implicit(2)
    _turn(reg, agent, keys(3, "a"))
    _turn(reg, stray, keys(3, "s"))
    assert reg.class_of(keys(3, "a")[0]) == CLOSED
    before = l3_metrics.get("session_tool_turns")
    assert reg.on_tool_call(agent)
    assert not reg.on_tool_call(_implicit(3))  # unknown: nothing to mark
    assert l3_metrics.get("session_tool_turns") - before == 1
    assert reg.class_of(keys(3, "a")[0]) == OPEN and reg.class_of(keys(3, "s")[0]) == CLOSED
    _turn(reg, agent, keys(4, "a"))  # the tool's result: the next turn keeps the count
    assert reg.get(agent).tool_calls == 1 and reg.get(agent).turns == 2


def test_a_tool_calling_first_turn_is_reaped_after_the_one_offs():
    reg = SessionRetention(None, "m" * 16, writer=False)
    agent = _implicit(0)
    _turn(reg, agent, keys(2, "agent"))  # the least recently used of all
    reg.on_tool_call(agent)
    for i in range(1, MAX_IMPLICIT + 5):
        _turn(reg, _implicit(i), keys(2, f"one-{i}"))
    assert reg.get(agent) is not None and reg.get(_implicit(1)) is None


def test_the_table_keeps_tool_calls_and_refuses_a_bad_count():
    rec = table.SessionRecord(_implicit(1), keys(2), 8, implicit=True, turns=1, tool_calls=2)
    (got,) = table.decode(table.encode("m", [rec]), "m")[1]
    assert got == rec and not got.one_off()
    with pytest.raises(table.TableError):
        table.decode(table.encode("m", [table.SessionRecord("b", keys(1), 4, tool_calls=-1)]), "m")


def test_a_client_cannot_name_another_agents_implicit_session(tmp_path):
    """Issue 49: the implicit-… ids are listed by GET /sglang_l3/sessions; a request naming
    one recorded its turn as that agent's (demoting the agent's L3 tail at queue time, even
    when cancelled). The id is ignored: the request is decided as if it named none."""
    tm = _TM(tmp_path)
    a_in = SYSTEM + _toks(2, 37)
    obj, tok = _tokenized(tm, a_in, "r1")
    victim = tok.session_id
    _answer(tm, obj, _toks(3, 20))
    before = l3_metrics.get("implicit_sessions", "claimed_id_ignored")
    _, spoof = _tokenized(tm, _toks(50, 90), "r2", session_id=victim)
    assert spoof.session_id != victim and table.is_implicit_id(spoof.session_id)
    assert l3_metrics.get("implicit_sessions", "claimed_id_ignored") == before + 1
    # the agent's own next call still continues it
    _, again = _tokenized(tm, a_in + _toks(3, 20) + _toks(4, 30), "r3")
    assert again.session_id == victim
    # an explicit id of the client's own stays the client's
    _, own = _tokenized(tm, a_in, "r4", session_id="agent-x")
    assert own.session_id == "agent-x"


def test_implicit_sessions_start_when_the_store_is_attached_at_run_time(tmp_path):
    """Issue 49: with no store at the first request, "off" was kept for the server's
    life; a store attached later (PUT /hicache/storage-backend) now turns them on."""
    tm = _TM(tmp_path)
    tm.server_args.hicache_storage_backend = None
    _, tok = _tokenized(tm, SYSTEM + _toks(2, 37), "r1")
    assert tok.session_id is None
    tm.server_args.hicache_storage_backend = "file"  # attached
    _, tok = _tokenized(tm, SYSTEM + _toks(2, 37), "r2")
    assert table.is_implicit_id(tok.session_id)
