"""Patch `session-device-tokens` on the real cache stack (both tree cores): the
tokens of each session's last context on the device, as `sglang-l3 top` shows
them, follow the tree: A's context leaves the device when B's needs the rows,
comes back when A is restored from L3, and asking changes nothing (the tree's
node ids and the free rows are the same before and after)."""

from __future__ import annotations

from array import array

import pytest
from sglang_l3.patches.sessions.session_device_tokens import device_tokens
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack

pytestmark = pytest.mark.usefixtures("small_host_reserve")

A = list(range(1, 277))  # 276 tokens + 1 output: 277 of the 512-row device pool
B = list(range(2000, 2300))  # 300 tokens + 1: fits only by evicting most of A
KV_ROWS = 512


def _serve(h: SchedulerHarness, ids: list[int], sid: str):
    req = h.make_req(ids)
    req.session_id = sid
    h.serve(req)
    h.stack.flush_backups()
    return req


def _full_device(st: L3Stack, ids: list[int]) -> int:
    """What upstream's own match says of ids' full-KV prefix on the device."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return int(st.cache.tree_core.match_full_device_prefix(RadixKey(array("q", ids)))[0])


@pytest.mark.parametrize("core", TREE_CORES)
def test_device_tokens_follow_the_tree(tmp_path, core) -> None:
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path), tree_core=core) as st:
        h = SchedulerHarness(st)
        assert device_tokens(st.cache) == {}  # no session finished yet
        a = _serve(h, A, "agent-a")
        got = device_tokens(st.cache)
        # the whole context but its last output token (whose KV was never computed)
        assert got == {"agent-a": len(A)}, got
        a_ctx = A + list(a.output_ids)

        b = _serve(h, B, "agent-b")
        b_ctx = B + list(b.output_ids)
        free = st.allocator.available_size()
        got = device_tokens(st.cache)
        assert got["agent-b"] == len(B) == _full_device(st, b_ctx), got
        assert got["agent-a"] == _full_device(st, a_ctx) < len(A), got  # B's rows came from A
        # asking twice gives the same and moves nothing
        assert device_tokens(st.cache) == got and st.allocator.available_size() == free

        # A's next turn restores its context from L3: A is back, B gave way
        turn = h.make_req(a_ctx + list(range(5000, 5008)))
        turn.session_id = "agent-a"
        h.serve(turn)
        st.flush_backups()
        got2 = device_tokens(st.cache)
        assert got2["agent-a"] == len(a_ctx) + 8 == _full_device(st, a_ctx + list(range(5000, 5008))), got2
        assert got2["agent-b"] == _full_device(st, b_ctx) < got["agent-b"], got2


def test_no_store_no_answer(tmp_path) -> None:
    """Without the sglang-l3 store there is nothing to say (None, not zeros)."""

    class _Plain:
        cache_controller = None

    assert device_tokens(_Plain()) is None
