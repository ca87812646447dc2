"""Patch `sessions` over the real cache stack (UnifiedRadixCache + buffer-only
HiCache + the sglang-l3 store, both tree cores, the real scheduler admission
path): a finished request of a session records exactly the chain of page keys
HiCache names its L3 pages with; the scheduler's session calls open/close it;
a fresh process (new stack over the same directory) still has the session.
Negative control: with the patch undone nothing is recorded."""

from __future__ import annotations

import os

import pytest
from sglang_l3.patches.sessions.sessions import registry_of
from sglang_l3.storage.format import parse_page_name
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack

# Under every simulated-device seed (test/integration/conftest.py); the second seed
# only on the Rust tree core (suite time).
pytestmark = [pytest.mark.all_seeds(core=("rust",)), pytest.mark.usefixtures("small_host_reserve")]

SEQ = list(range(1, 277))  # 276 tokens; page size 1 (one L3 page per token and pool)


def _kv_keys(root) -> set[str]:
    names = (parse_page_name(n) for n in os.listdir(os.path.join(root, "pages")))
    return {n.key for n in names if n is not None and n.pool == "kv"}


def _serve(h: SchedulerHarness, seq, sid=None):
    req = h.make_req(seq)
    if sid is not None:
        req.session_id = sid
    h.serve(req)
    h.stack.flush_backups()
    return req


def _scheduler_calls(h: SchedulerHarness, st: L3Stack):
    from sglang.srt.managers.io_struct import CloseSessionReqInput, OpenSessionReqInput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.session.session_controller import SessionController

    h.s.enable_session_radix_cache = False
    h.s.session_controller = SessionController(st.cache)
    from sglang.srt.runtime_context import get_parallel

    def open_session(sid):
        with get_parallel().override(attn_cp_rank=0):
            return Scheduler.open_session(h.s, OpenSessionReqInput(capacity_of_str_len=0, session_id=sid))

    return (
        open_session,
        lambda sid: Scheduler.close_session(h.s, CloseSessionReqInput(session_id=sid)),
    )


def test_session_chain_is_the_l3_chain_and_survives_a_restart(tmp_path, core):
    spec = HybridSpec(page_size=1, kv_size=2048)
    with L3Stack(spec, str(tmp_path), tree_core=core) as st:
        h = SchedulerHarness(st)
        req = _serve(h, SEQ, "agent-a")
        _serve(h, list(range(500, 600)))  # plain: no session
        reg = registry_of(st.cache)
        assert reg is not None
        rec = reg.get("agent-a")
        assert rec is not None and rec.open and rec.tokens == len(SEQ) + 1
        assert len(rec.keys) == len(SEQ) + 1
        assert [r.id for r in reg.records()] == ["agent-a"]
        stored = _kv_keys(tmp_path)
        mine = stored & set(rec.keys)
        # every page of the session's prefix that HiCache stored carries a key of the chain
        assert len(mine) >= 256, (len(mine), len(stored))
        assert rec.keys[: len(mine)] == [k for k in rec.keys if k in mine]
        open_session, close_session = _scheduler_calls(h, st)
        close_session("agent-a")
        assert reg.get("agent-a").open is False
        open_session("agent-a")
        assert reg.get("agent-a").open is True
        assert req.session_id == "agent-a"
    with L3Stack(spec, str(tmp_path), tree_core=core) as fresh:
        again = registry_of(fresh.cache).get("agent-a")
        assert again is not None and again.keys == rec.keys and again.open


@pytest.mark.parametrize("without", ["sessions"], indirect=True)
def test_without_patch_nothing_is_recorded(tmp_path, without):
    with L3Stack(HybridSpec(page_size=1, kv_size=2048), str(tmp_path)) as st:
        h = SchedulerHarness(st)
        _serve(h, SEQ, "agent-a")
        assert registry_of(st.cache).get("agent-a") is None


def test_prefill_only_hint_restores_from_l3_and_leaves_the_context_on_device(tmp_path, core):
    """What a "speaks next" hint is to the scheduler: a prefill-only request
    (max_new_tokens 0) for the context. Through upstream's admission path it
    restores the prefix from L3 and leaves it on the device, so the next turn
    matches on the device and reads nothing from L3."""
    spec = HybridSpec(page_size=1, kv_size=2048)
    with L3Stack(spec, str(tmp_path), tree_core=core) as st:
        h = SchedulerHarness(st)
        _serve(h, SEQ, "agent-a")
        ctx = SEQ + [7]  # the turn's context: prompt + its output token
        st.evict_all()
        assert st.match(ctx).device_prefix_len == 0
        backend = st.cache.cache_controller.storage_backend
        reads = backend.store.counters.get("read_hits")
        hint = h.make_req(ctx, rid="sglang-l3-hint-test", max_new_tokens=0)
        h.serve(hint)
        st.flush_backups()
        assert backend.store.counters.get("read_hits") > reads, "the hint did not read from L3"
        on_device = st.match(ctx).device_prefix_len
        assert on_device >= 256, on_device
        reads = backend.store.counters.get("read_hits")
        nxt = h.make_req(ctx + list(range(900, 920)))
        h.arrive(nxt)
        h.wait_prefetch(nxt)
        assert backend.store.counters.get("read_hits") == reads, "the next turn read L3 again"


def _running_turn_under_the_cap(tmp_path, core, *, protect_at_arrival: bool = True):
    """Turn 1 of a session finishes; turn 2 (its history + 300 new tokens) runs
    chunk by chunk, and its chunks reach L3 before it finishes; then the store's
    byte cap is lowered to what it holds and plain pages are written. Returns
    (the running turn's new pages that were on disk, those still on disk)."""
    import hashlib

    import torch

    spec = HybridSpec(page_size=1, kv_size=2048)
    # a cap enables upstream's evictor; it is lowered once the scenario is in place
    with L3Stack(spec, str(tmp_path), tree_core=core, extra_config={"max_bytes": 2**30, "min_free_bytes": 0}) as st:
        h = SchedulerHarness(st, chunked_prefill_size=128)
        _serve(h, SEQ, "agent-a")
        turn2 = h.make_req(SEQ + [7] + list(range(700, 1000)))
        turn2.session_id = "agent-a"
        reg = registry_of(st.cache)
        turn1 = reg.get("agent-a")
        h.arrive(turn2)
        if not protect_at_arrival:  # control: the chain stays turn 1's until release
            reg.on_turn("agent-a", turn1.keys, turn1.tokens)
        h.wait_prefetch(turn2)
        h.forward(h.admit())
        for _ in range(1):  # a second chunk; the turn is still prefilling after it
            h.stash_chunk()
            h.forward(h.admit())
        assert h.s.chunked_req is turn2 and not turn2.finished()
        st.flush_backups()
        backend = st.cache.cache_controller.storage_backend
        from sglang_l3.patches.sessions.sessions import context_keys

        chain, _ = context_keys(st.cache, turn2)
        new = [k for k in chain[len(SEQ) + 1 :] if backend.exists(k)]
        assert len(new) >= 64, "the running turn wrote nothing to L3 yet"
        evictor = backend.store.evictor
        plain = [hashlib.sha256(f"plain-{i}".encode()).hexdigest() for i in range(2 * len(new))]
        half = len(new)
        idx = torch.arange(half, dtype=torch.int64)
        assert all(backend.batch_set_v1(plain[:half], idx))  # older plain traffic
        with evictor._lock:
            evictor.max_size_bytes = evictor._total_bytes
            evictor.eviction_ratio = 1.0
        assert all(backend.batch_set_v1(plain[half:], idx))  # forces evictions
        kept = [k for k in new if backend.exists(k)]
        return new, kept


def test_a_running_turns_pages_are_protected_before_it_finishes(tmp_path, core):
    new, kept = _running_turn_under_the_cap(tmp_path, core)
    assert kept == new, f"{len(new) - len(kept)} of the running turn's {len(new)} pages were evicted"


def test_control_a_running_turns_pages_go_first_when_recorded_only_at_release(tmp_path):
    new, kept = _running_turn_under_the_cap(tmp_path, "rust", protect_at_arrival=False)
    assert len(kept) < len(new)


def test_drop_through_the_scheduler_forgets_the_session(tmp_path):
    """What DELETE /sglang_l3/sessions/{id} sends every scheduler rank: upstream's
    CloseSessionReqInput with DROP_MARK before the id. The registry forgets the
    session (the table too); upstream's session controller never sees it; a
    plain close still closes."""
    from sglang.srt.managers.io_struct import CloseSessionReqInput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.session.session_controller import SessionController
    from sglang_l3.patches.sessions.sessions import DROP_MARK

    spec = HybridSpec(page_size=1, kv_size=2048)
    with L3Stack(spec, str(tmp_path)) as st:
        h = SchedulerHarness(st)
        h.s.enable_session_radix_cache = False
        h.s.session_controller = SessionController(st.cache)
        _serve(h, SEQ, "agent-a")
        _serve(h, list(range(500, 600)), "agent-b")
        reg = registry_of(st.cache)
        seen = []
        h.s.session_controller.close = lambda req: seen.append(req.session_id)
        Scheduler.close_session(h.s, CloseSessionReqInput(session_id=DROP_MARK + "agent-a"))
        assert reg.get("agent-a") is None and seen == []
        Scheduler.close_session(h.s, CloseSessionReqInput(session_id=DROP_MARK + "nobody"))  # no-op
        Scheduler.close_session(h.s, CloseSessionReqInput(session_id="agent-b"))
        assert seen == ["agent-b"] and reg.get("agent-b").open is False
        assert reg.flush()
    with L3Stack(spec, str(tmp_path)) as fresh:
        again = registry_of(fresh.cache)
        assert again.get("agent-a") is None and again.get("agent-b") is not None


def _rewritten_history(tmp_path, core, *, demote: bool = True):
    """Issue 31 item 4 over the real stack: plain traffic P, then agent-a's turn 1
    (SEQ), then a turn 2 that keeps only SEQ's first 40 tokens (its history was
    compressed). The byte cap is lowered to what the store holds and new plain
    pages are written. Returns (registry, turn 1's chain, its stale tail's pages
    that were on disk, those still on disk, P's pages on disk before, after)."""
    import hashlib

    import torch
    from sglang_l3.patches.sessions.sessions import context_keys
    from sglang_l3.storage.retention import SessionRetention

    spec = HybridSpec(page_size=1, kv_size=2048)
    with L3Stack(spec, str(tmp_path), tree_core=core, extra_config={"max_bytes": 2**30, "min_free_bytes": 0}) as st:
        h = SchedulerHarness(st)
        p_req = _serve(h, list(range(500, 700)))  # plain, older than the session's pages
        turn1 = _serve(h, SEQ, "agent-a")
        reg = registry_of(st.cache)
        old = reg.get("agent-a").keys
        assert old == context_keys(st.cache, turn1)[0]
        if not demote:  # control: the registry does not look at the old chain
            reg._stale_tail = lambda old, keys: []
        _serve(h, SEQ[:40] + list(range(2000, 2200)), "agent-a")
        backend = st.cache.cache_controller.storage_backend
        p_keys = context_keys(st.cache, p_req)[0]
        stale = [k for k in old[40:] if backend.exists(k)]
        p_before = [k for k in p_keys if backend.exists(k)]
        assert len(stale) >= 64 and len(p_before) >= 64, (len(stale), len(p_before))
        assert all(backend.exists(k) for k in old[:40])
        evictor = backend.store.evictor
        fresh = [hashlib.sha256(f"fresh-{i}".encode()).hexdigest() for i in range(len(stale) // 2)]
        with evictor._lock:
            evictor.max_size_bytes = evictor._total_bytes
            evictor.eviction_ratio = 1.0
        assert all(backend.batch_set_v1(fresh, torch.arange(len(fresh), dtype=torch.int64)))
        kept = [k for k in stale if backend.exists(k)]
        p_after = [k for k in p_keys if backend.exists(k)]
        shared_kept = all(backend.exists(k) for k in old[:40])
        assert isinstance(reg, SessionRetention)
        return reg, old, stale, kept, p_before, p_after, shared_kept


def test_a_rewritten_historys_stale_tail_is_evicted_first(tmp_path, core):
    from sglang_l3.storage.retention import DEMOTED, OPEN

    reg, old, stale, kept, p_before, p_after, shared_kept = _rewritten_history(tmp_path, core)
    assert reg.class_of(old[100]) == DEMOTED and reg.class_of(old[10]) == OPEN
    assert len(kept) < len(stale), "the stale tail was not evicted"
    assert p_after == p_before, "plain pages went before the rewritten history's stale tail"
    assert shared_kept, "the shared prefix must stay"


def test_control_without_demotion_plain_pages_go_first(tmp_path):
    _, _, stale, kept, p_before, p_after, _ = _rewritten_history(tmp_path, "rust", demote=False)
    assert len(p_after) < len(p_before) and kept == stale
