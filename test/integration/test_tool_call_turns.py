"""Patch `tool-call-turns`, the scheduler side, on the real cache stack: the
message that a turn ended in a tool call is taken out of the received list
before upstream sees it, and the store's registry then ranks the implicit
session that made the call as a conversation (its L3 pages are evicted after
every one-off prompt's)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_l3.patches.sessions import tool_call_turns as patch
from sglang_l3.patches.sessions.sessions import context_keys, registry_of
from sglang_l3.sessions.rpc import TOOL_TURN as METHOD
from sglang_l3.storage.retention import CLOSED, OPEN
from sglang_l3.storage.sessions import IMPLICIT_PREFIX
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack

AGENT = f"{IMPLICIT_PREFIX}{1:032x}"
STRAY = f"{IMPLICIT_PREFIX}{2:032x}"


def test_the_message_reaches_the_registry_and_nothing_else_changes(tmp_path):
    from sglang.srt.managers.io_struct import RpcReqInput

    with L3Stack(HybridSpec(page_size=4, kv_size=1024), str(tmp_path)) as st:
        h = SchedulerHarness(st)
        first = {}
        for sid, base in ((AGENT, 1), (STRAY, 1001)):
            req = h.make_req(list(range(base, base + 64)))
            req.session_id = sid
            h.serve(req)
            first[sid] = context_keys(st.cache, req)[0][0]
        reg = registry_of(st.cache)
        assert reg is not None and reg.get(AGENT).turns == 1
        assert reg.class_of(first[AGENT]) == CLOSED == reg.class_of(first[STRAY])

        other = RpcReqInput(method="something_else", parameters={})
        msgs = [RpcReqInput(method=METHOD, parameters={"session": AGENT}), other]
        seen: list = []
        sched = SimpleNamespace(tree_cache=st.cache)
        patch._process_input_requests(lambda s, reqs: seen.extend(reqs), sched, msgs)
        assert seen == [other]  # upstream sees the rest, in order, and never ours
        assert reg.class_of(first[AGENT]) == OPEN and reg.class_of(first[STRAY]) == CLOSED
        assert reg.get(AGENT).tool_calls == 1

        # a message for a session the registry does not know changes nothing
        patch._process_input_requests(
            lambda s, reqs: None, sched, [RpcReqInput(method=METHOD, parameters={"session": "implicit-none"})]
        )
        assert [r.id for r in reg.records() if r.tool_calls] == [AGENT]


def test_without_a_store_registry_the_message_is_dropped(tmp_path):
    from sglang.srt.managers.io_struct import RpcReqInput

    seen: list = []
    sched = SimpleNamespace(tree_cache=SimpleNamespace())
    patch._process_input_requests(
        lambda s, reqs: seen.extend(reqs), sched, [RpcReqInput(method=METHOD, parameters={"session": AGENT})]
    )
    assert seen == []
