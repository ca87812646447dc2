"""Issue 13, stages 1-2: L3 retention by session in the store's evictor, and
the persisted per-model session table (restart, corrupt/foreign tables)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from sglang_l3 import metrics as l3_metrics
from sglang_l3.storage import sessions as table
from test_store_support import fill_random, keys, make_kv_pool, make_store


def _idx(n, ps=4, start=0):
    return torch.arange(start * ps, (start + n) * ps, dtype=torch.int64)


def _file_len(tmp_path, kv):
    probe = make_store(tmp_path / "probe", kv=kv)
    n = probe._specs["kv"].file_len
    probe.close()
    return n


def _capped(tmp_path, kv, pages, name="s", **extra):
    return make_store(
        tmp_path / name,
        kv=kv,
        extra={"max_bytes": pages * _file_len(tmp_path, kv), **extra},
    )


def _present(st, ks):
    return [st.exists(k) for k in ks]


def test_open_session_pages_outlive_plain_pages_under_the_cap(tmp_path):
    kv = make_kv_pool()
    fill_random(kv, 1)
    st = _capped(tmp_path, kv, 10)
    a = keys(4, "a")
    assert all(st.batch_set_v1(a, _idx(4)))
    assert st.store.sessions.on_turn("agent-a", a, tokens=16)
    plain = keys(24, "p")
    for i in range(0, 24, 2):  # plain traffic, far more than the cap
        assert st.batch_set_v1(plain[i : i + 2], _idx(2)) == [True, True]
    assert _present(st, a) == [True] * 4, "an open session's context must stay restorable"
    assert not st.exists(plain[0])
    c = st.counters()
    assert c["evicted_plain"] >= 14 and c.get("evicted_open", 0) == 0
    assert l3_metrics.get("l3_evictions", "plain") >= 14
    s = st.store.sessions.stats(st.store.evictor.sizes())
    assert s["open_pages"] == 4 and s["sessions_open"] == 1
    st.close()


def test_plain_store_without_sessions_is_plain_lru(tmp_path):
    """Control: the same traffic without the session evicts the context."""
    kv = make_kv_pool()
    fill_random(kv, 1)
    st = _capped(tmp_path, kv, 10)
    a = keys(4, "a")
    assert all(st.batch_set_v1(a, _idx(4)))
    plain = keys(24, "p")
    for i in range(0, 24, 2):
        st.batch_set_v1(plain[i : i + 2], _idx(2))
    assert _present(st, a) == [False] * 4
    st.close()


def test_closing_releases_the_protection(tmp_path):
    kv = make_kv_pool()
    fill_random(kv, 1)
    st = _capped(tmp_path, kv, 8)
    a, b = keys(4, "a"), keys(4, "b")
    assert all(st.batch_set_v1(a + b, _idx(8)))
    reg = st.store.sessions
    reg.on_turn("a", a, 16)
    reg.on_turn("b", b, 16)
    assert reg.close("a") and not reg.close("a")
    assert st.batch_set_v1(keys(1, "p"), _idx(1)) == [True]  # 9 > cap 8: evict down to 6
    assert _present(st, a) == [
        True,
        True,
        False,
        False,
    ]  # the closed session, deepest first
    assert _present(st, b) == [True] * 4
    assert st.counters()["evicted_closed"] == 2 and st.counters().get("evicted_open", 0) == 0
    st.close()


def test_while_open_the_same_pressure_evicts_the_older_open_session(tmp_path):
    """Control for the test above: without the close, a and b are both open and
    the older one loses its deepest pages - the class, not the age, made b safe."""
    kv = make_kv_pool()
    fill_random(kv, 1)
    st = _capped(tmp_path, kv, 8)
    a, b = keys(4, "a"), keys(4, "b")
    assert all(st.batch_set_v1(a + b, _idx(8)))
    clock = [1.0]
    st.store.sessions._now = lambda: clock[0]
    st.store.sessions.on_turn("b", b, 16)
    clock[0] = 2.0
    st.store.sessions.on_turn("a", a, 16)
    assert st.batch_set_v1(keys(1, "p"), _idx(1)) == [True]
    assert _present(st, a) == [True] * 4
    assert _present(st, b) == [True, True, False, False]
    assert st.counters()["evicted_open"] == 2
    st.close()


def test_open_sessions_go_by_priority_then_age_deepest_first(tmp_path):
    kv = make_kv_pool()
    fill_random(kv, 1)
    clock = [1000.0]
    st = _capped(tmp_path, kv, 8)
    reg = st.store.sessions
    reg._now = lambda: clock[0]
    lo, old, new = keys(3, "lo"), keys(2, "old"), keys(2, "new")
    assert all(st.batch_set_v1(lo + old + new, _idx(7)))
    reg.on_turn("lo", lo, 12, priority=-1)
    clock[0] += 1
    reg.on_turn("old", old, 8, priority=5)
    clock[0] += 1
    reg.on_turn("new", new, 8, priority=5)
    x = keys(2, "x")
    assert st.batch_set_v1(x, _idx(2)) == [
        True,
        True,
    ]  # 9 pages > cap 8: evict down to 6
    assert _present(st, lo) == [
        True,
        False,
        False,
    ]  # lowest priority, deepest pages first
    assert _present(st, old + new + x) == [True] * 6
    # The rest of the order: plain (in LRU order), lo's first page, then the older session, deepest first.
    stems = [k + ".kv" for k in reversed(new + old + lo[:1] + x)]  # any LRU order
    want = [x[1] + ".kv", x[0] + ".kv"] + [
        lo[0] + ".kv",
        old[1] + ".kv",
        old[0] + ".kv",
        new[1] + ".kv",
        new[0] + ".kv",
    ]
    assert reg.order(stems) == want
    st.close()


def test_free_space_floor_wins_over_retention(tmp_path):
    kv = make_kv_pool()
    fill_random(kv, 1)
    n = _file_len(tmp_path, kv)
    st = make_store(tmp_path / "s", kv=kv, extra={"min_free_bytes": "1Mi"})
    a = keys(4, "a")
    assert all(st.batch_set_v1(a, _idx(4)))
    st.store.sessions.on_turn("a", a, 16, priority=100)
    ev = st.store.evictor
    floor = ev.min_free_bytes
    # Another tenant filled the disk: one page below the floor. Each eviction
    # gives its page's bytes back (the probe stands in for statvfs).
    ev._fs_stats = lambda: (
        1 << 40,
        floor - n + n * int(st.store.counters.get("evicted")),
    )
    assert st.batch_set_v1(keys(1, "p"), _idx(1)) == [True]
    assert st.counters()["evicted_open"] == 2, "the floor must evict an open session's pages"
    assert _present(st, a) == [True, True, False, False]  # deepest first
    st.close()


def test_sessions_survive_a_restart_and_keep_retention(tmp_path):
    kv = make_kv_pool()
    fill_random(kv, 1)
    cap = 10 * _file_len(tmp_path, kv)
    st = make_store(tmp_path / "s", kv=kv, extra={"max_bytes": cap})
    a = keys(4, "a")
    assert all(st.batch_set_v1(a, _idx(4)))
    st.store.sessions.on_turn("agent-a", a, tokens=16, priority=3)
    st.store.sessions.on_turn("gone", keys(2, "g"), tokens=8)
    st.store.sessions.close("gone")
    st.close()  # flushes the table

    st2 = make_store(tmp_path / "s", kv=kv, extra={"max_bytes": cap})
    rec = st2.store.sessions.get("agent-a")
    assert rec is not None and rec.keys == a and rec.tokens == 16 and rec.priority == 3 and rec.open
    assert st2.store.sessions.get("gone").open is False
    assert st2.store.sessions.load_reason is None
    plain = keys(24, "p")
    for i in range(0, 24, 2):
        st2.batch_set_v1(plain[i : i + 2], _idx(2))
    assert _present(st2, a) == [True] * 4
    st2.close()


def test_only_rank0_writes_the_table(tmp_path):
    kv = make_kv_pool()
    st1 = make_store(tmp_path, kv=kv, tp_rank=1, tp_size=2)
    st1.store.sessions.on_turn("a", keys(1), 4)
    st1.close()
    assert table.list_tables(tmp_path) == []
    st0 = make_store(tmp_path, kv=kv, tp_rank=0, tp_size=2)
    st0.store.sessions.on_turn("a", keys(1), 4)
    st0.close()
    assert len(table.list_tables(tmp_path)) == 1
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("damage", ["garbage", "truncated", "checksum", "foreign", "symlink", "bad_key"])
def test_corrupt_or_foreign_table_is_ignored_with_a_reason(tmp_path, caplog, damage):
    kv = make_kv_pool()
    st = make_store(tmp_path, kv=kv)
    st.store.sessions.on_turn("a", keys(2), 8)
    mid = st.store.mid
    st.close()
    path = table.table_path(tmp_path, mid)
    with open(path, "rb") as f:
        data = f.read()
    if damage == "garbage":
        data = b"\x00\xffnot a table"
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "checksum":
        data = data.replace(b'"tokens":8', b'"tokens":9')
    elif damage == "foreign":
        data = table.encode("0" * len(mid), [table.SessionRecord("a", keys(2), 8)])
    elif damage == "bad_key":
        data = table.encode(mid, [table.SessionRecord("a", ["../../etc"], 8)])
    if damage == "symlink":
        real = tmp_path / "elsewhere"
        os.replace(path, real)
        os.symlink(real, path)
    else:
        with open(path, "wb") as f:
            f.write(data)
    with caplog.at_level(logging.WARNING, logger="sglang_l3.storage.sessions"):
        st2 = make_store(tmp_path, kv=kv)
    assert st2.store.sessions.records() == []
    assert st2.store.sessions.load_reason
    assert "ignoring session table" in caplog.text
    st2.close()


def test_table_round_trip_and_validation():
    recs = [
        table.SessionRecord("s1", keys(3), 12, 2, 5.0, True),
        table.SessionRecord("s2", [], 0, 0, 1.0, False),
    ]
    mid, got = table.decode(table.encode("m", recs), "m")
    assert mid == "m" and got == recs
    body = json.loads(table.encode("m", recs).split(b"\n", 1)[1])
    assert body["format"] == table.FORMAT
    with pytest.raises(table.TableError):
        table.decode(table.encode("m", recs), "other")


def test_rewritten_history_demotes_the_stale_tail_before_plain_pages(tmp_path):
    """Issue 31 item 4 on the store: a session's new turn that diverges inside
    its previous input demotes the old chain's tail (before every plain page);
    the shared prefix stays the session's; an ordinary next turn demotes nothing."""
    from sglang_l3.storage.retention import DEMOTED, OPEN, PLAIN

    kv = make_kv_pool()
    fill_random(kv, 1)
    st = _capped(tmp_path, kv, 14)
    reg = st.store.sessions
    plain = keys(4, "p")
    assert all(st.batch_set_v1(plain, _idx(4)))  # older than the session's pages
    old = keys(8, "a")
    assert all(st.batch_set_v1(old, _idx(8)))
    reg.on_turn("agent-a", old[:6], 24, finished=False)
    reg.on_turn("agent-a", old, 32, input_pages=6)
    # an ordinary next turn (diverging after the input, or extending input + output) demotes nothing
    b = keys(5, "b")
    reg.on_turn("agent-b", b, 20, input_pages=3)
    reg.on_turn("agent-b", b[:3] + keys(2, "b2"), 20, finished=False)
    reg.on_turn("agent-b", b[:3] + keys(2, "b2") + keys(1, "b3"), 24, input_pages=5)
    assert not any(reg.demoted(k) for k in b)
    rewritten = old[:2] + keys(3, "r")  # compressed: shares only 2 pages
    reg.on_turn("agent-a", rewritten, 20, finished=False)
    assert [reg.class_of(k) for k in old] == [OPEN, OPEN] + [DEMOTED] * 6
    assert reg.class_of(plain[0]) == PLAIN
    assert all(st.batch_set_v1(rewritten[2:], _idx(3)))
    assert all(st.batch_set_v1(keys(4, "q"), _idx(4)))  # 4 + 8 + 3 + 4 pages > cap 14
    assert _present(st, plain) == [True] * 4, "plain pages went before the stale tail"
    assert _present(st, old[:2]) == [True, True]
    assert not all(_present(st, old[2:]))
    assert st.counters()["evicted_demoted"] >= 5
    # the demoted tail becomes the session's again if a turn reaches it
    reg.on_turn("agent-a", old, 32, finished=False)
    assert reg.class_of(old[5]) == OPEN
    st.close()


def test_an_agents_first_turn_that_ended_in_a_tool_call_outlives_newer_one_off_prompts(tmp_path):
    """Issue 31 item 5 on the store: every request without a session id is an
    implicit session. An agent's first call that ended in a tool call (patch
    tool-call-turns) keeps its pages while newer one-off prompts push the store
    over its cap; an agent whose first call ended without one goes first, as
    before (a one-off so far)."""
    from sglang_l3.storage.sessions import IMPLICIT_PREFIX

    kv = make_kv_pool()
    fill_random(kv, 1)
    st = _capped(tmp_path, kv, 12)
    reg = st.store.sessions
    agent, quiet = f"{IMPLICIT_PREFIX}{1:032x}", f"{IMPLICIT_PREFIX}{2:032x}"
    a, q = keys(4, "agent"), keys(4, "quiet")
    for sid, ks in ((agent, a), (quiet, q)):
        assert all(st.batch_set_v1(ks, _idx(4)))
        reg.on_turn(sid, ks[:3], 12, finished=False)
        reg.on_turn(sid, ks, 16, input_pages=3)
    assert reg.on_tool_call(agent)
    for i in range(6):  # one-off prompts after the agents' calls: 8 + 12 pages > cap 12
        noise, sid = keys(2, f"noise-{i}"), f"{IMPLICIT_PREFIX}{100 + i:032x}"
        assert st.batch_set_v1(noise, _idx(2)) == [True, True]
        reg.on_turn(sid, noise[:1], 4, finished=False)
        reg.on_turn(sid, noise, 8, input_pages=1)
    assert _present(st, a) == [True] * 4, "the tool-calling agent's context went with the noise"
    assert not any(_present(st, q)), "the quiet first turn should rank as a one-off (least recently used first)"
    st.close()
