"""Patch `session-guard` over the real cache stack and scheduler admission path:
a "speaks next" hint whose device stage would evict an open session's device
context is declined before it is queued (no L3 read, no allocation, no
eviction); once the session is closed the same hint is admitted and lands.
Negative control: without the patch the hint evicts the open session."""

from __future__ import annotations

import pytest
from sglang_l3.patches.sessions import registry_of
from sglang_l3.session_hints import DEFERRED_DEVICE_FULL, HINT_EVICT_PREFIX
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack

A = list(range(1, 277))  # 276 tokens + 1 output token: 277 of the 512-row device pool
B = list(range(2000, 2300))  # 300 tokens: fits only by evicting A
SMALL = list(range(3000, 3100))  # 100 tokens: fits in the free rows
KV_ROWS = 512


@pytest.fixture(autouse=True)
def _small_host_reserve(monkeypatch):
    from sglang.srt.mem_cache.pool_host import base

    monkeypatch.setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 256 * 2**20)


@pytest.fixture(params=TREE_CORES)
def core(request) -> str:
    return request.param


def _setup(st: L3Stack) -> tuple[SchedulerHarness, list, list[int]]:
    h = SchedulerHarness(st)
    sent: list = []
    h.s.send_abort_output = lambda abort, req: sent.append((abort, req))
    a = h.make_req(A)
    a.session_id = "agent-a"
    h.serve(a)
    st.flush_backups()
    return h, sent, A + [7]  # A's context: prompt + its output token


def _hint(h: SchedulerHarness, ids: list[int], name: str):
    return h.make_req(ids, rid=f"sglang-l3-hint-{name}", max_new_tokens=0)


def test_hint_never_evicts_an_open_sessions_device_context(tmp_path, core):
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path), tree_core=core) as st:
        h, sent, ctx_a = _setup(st)
        resident = st.match(ctx_a).device_prefix_len
        assert resident >= 256, resident
        free = st.allocator.available_size()
        reads = st.cache.cache_controller.storage_backend.store.counters.get("read_hits")

        hint = _hint(h, B, "b")
        h.arrive(hint)
        assert hint not in h.s.waiting_queue
        assert len(sent) == 1 and sent[0][1] is hint
        reason = sent[0][0].finished_reason
        assert DEFERRED_DEVICE_FULL in reason["message"] and "agent-a" in reason["message"], reason
        assert st.match(ctx_a).device_prefix_len == resident, "the open session's device context was touched"
        assert st.allocator.available_size() == free
        assert st.cache.cache_controller.storage_backend.store.counters.get("read_hits") == reads

        # a hint that fits in the free rows evicts nothing: it is admitted
        small = _hint(h, SMALL, "small")
        h.serve(small)
        assert len(sent) == 1
        assert st.match(ctx_a).device_prefix_len == resident
        assert st.match(SMALL).device_prefix_len > 0

        # closing the session releases the protection: the hint lands, A leaves the device
        registry_of(st.cache).close("agent-a")
        again = _hint(h, B, "b2")
        h.serve(again)
        assert len(sent) == 1
        assert st.match(B).device_prefix_len > 0
        assert st.match(ctx_a).device_prefix_len < resident


@pytest.mark.parametrize("without", ["session-guard"], indirect=True)
def test_without_guard_the_hint_evicts_the_open_session(tmp_path, without):
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path)) as st:
        h, sent, ctx_a = _setup(st)
        resident = st.match(ctx_a).device_prefix_len
        h.serve(_hint(h, B, "b"))
        assert not sent
        assert st.match(ctx_a).device_prefix_len < resident


def test_a_hint_sent_with_evict_open_is_not_guarded(tmp_path):
    """`"evict_open": true` on the hint (rid prefix HINT_EVICT_PREFIX): the
    client knows who speaks next; the hint is admitted and A leaves the device."""
    with L3Stack(HybridSpec(page_size=1, kv_size=KV_ROWS), str(tmp_path)) as st:
        h, sent, ctx_a = _setup(st)
        resident = st.match(ctx_a).device_prefix_len
        h.serve(h.make_req(B, rid=HINT_EVICT_PREFIX + "b", max_new_tokens=0))
        assert not sent
        assert st.match(B).device_prefix_len > 0
        assert st.match(ctx_a).device_prefix_len < resident
