"""`sglang-l3 sessions ls|show|drop` offline on a store directory (issue 13)."""

from __future__ import annotations

import hashlib
import json
import os

from sglang_l3 import cli
from sglang_l3.storage import sessions as table
from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
from sglang_l3.storage.safety import StoreDirs
from sglang_l3.storage.store import PageStore, WriteItem

KVB = 8192


def _k(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def _store(root):
    st = PageStore(
        StoreSettings(root=root, min_free="0"),
        ModelIdentity(model="org/model-a"),
        Shard(),
        sweep_strays=False,
    )
    kv = st.pool_spec(PoolLayout("kv", "page_first", 64, (("bfloat16", (KVB // 2,)),), KVB))
    return st, kv


def _populate(root):
    st, kv = _store(root)
    a = [_k(f"a{i}") for i in range(4)]
    b = [_k(f"b{i}") for i in range(3)]
    # a: pages 0, 1, 3 on disk (2 evicted) -> restorable prefix 2; b: nothing on disk
    assert all(st.write([WriteItem(k, kv, [memoryview(bytearray(KVB))]) for k in (a[0], a[1], a[3])]))
    st.sessions.on_turn("agent-a", a, 256, priority=2)
    st.sessions.on_turn("agent-b", b, 192)
    st.sessions.close("agent-b")
    mid = st.mid
    st.close()
    return mid, a, b


def test_ls_show_drop(tmp_path, capsys):
    root = tmp_path / "store"
    mid, a, _ = _populate(root)
    assert cli.main(["sessions", "--dir", str(root), "ls", "--json"]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["agent-a"]["state"] == "open" and rows["agent-b"]["state"] == "closed"
    assert rows["agent-a"]["stored_pages"] == 3 and rows["agent-a"]["restorable_pages"] == 2
    assert rows["agent-a"]["chain_pages"] == 4 and rows["agent-a"]["tokens"] == 256
    assert rows["agent-a"]["bytes"] == sum(
        os.path.getsize(os.path.join(root, "pages", n)) for n in os.listdir(root / "pages")
    )
    assert rows["agent-b"]["stored_pages"] == 0 and rows["agent-a"]["mid"] == mid
    assert cli.main(["sessions", "--dir", str(root), "ls"]) == 0
    out = capsys.readouterr().out
    assert "agent-a" in out and "open" in out and "closed" in out
    assert cli.main(["sessions", "--dir", str(root), "show", "agent-a"]) == 0
    assert "restorable prefix 2 pages" in capsys.readouterr().out
    assert cli.main(["sessions", "--dir", str(root), "ls", "--model", "org/other"]) == 0
    assert "no sessions" in capsys.readouterr().out
    assert cli.main(["sessions", "--dir", str(root), "drop", "agent-b"]) == 0
    with StoreDirs(root, create=False) as dirs:
        records, reason = table.load(dirs, mid)
    assert reason is None and [r.id for r in records] == ["agent-a"]
    assert cli.main(["sessions", "--dir", str(root), "show", "agent-b"]) == 1
    # a restarted store sees the drop
    st, _ = _store(root)
    assert st.sessions.get("agent-b") is None and st.sessions.get("agent-a").keys == a
    st.close()


def test_ls_reports_a_damaged_table_instead_of_crashing(tmp_path, capsys):
    root = tmp_path / "store"
    mid, _, _ = _populate(root)
    with open(table.table_path(root, mid), "r+b") as f:
        f.seek(80)
        f.write(b"XXXX")
    assert cli.main(["sessions", "--dir", str(root), "ls"]) == 0
    assert "ignored: checksum mismatch" in capsys.readouterr().out
