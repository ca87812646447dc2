"""`sglang-l3 store` stats / ls / verify / evict / clear, doctor, coverage."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from sglang_l3.storage import cli, doctor, index
from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.format import header_len_for
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
from sglang_l3.storage.store import PageStore, WriteItem

KVB, MB = 8192, 20000


def _k(s):
    return hashlib.sha256(s.encode()).hexdigest()


@pytest.fixture
def populated(tmp_path):
    root = tmp_path / "store"
    st = PageStore(
        StoreSettings(root=root, min_free="0"), ModelIdentity(model="org/model-a"), Shard(), sweep_strays=False
    )
    kv = st.pool_spec(PoolLayout("kv", "page_first", 64, (("bfloat16", (KVB // 2,)),), KVB))
    mb = st.pool_spec(PoolLayout("mamba", "page_first", 1, (("float32", (MB // 4,)),), MB))
    chain = [_k(f"a{i}") for i in range(4)]
    items = [
        WriteItem(k, kv, [memoryview(bytearray(os.urandom(KVB)))], prior=(chain[i - 1] if i else ""), depth=i)
        for i, k in enumerate(chain)
    ]
    # A second chain whose first link is unknown (no prefix keys passed).
    other = [_k(f"b{i}") for i in range(2)]
    items += [
        WriteItem(k, kv, [memoryview(bytearray(KVB))], prior=(other[0] if i else None)) for i, k in enumerate(other)
    ]
    assert all(st.write(items))
    assert st.write([WriteItem(chain[1], mb, [memoryview(bytearray(MB))], depth=1)]) == [True]
    st.close()
    st_b = PageStore(
        StoreSettings(root=root, min_free="0"),
        ModelIdentity(model="org/model-b"),
        Shard(tp_rank=1, tp_size=2),
        sweep_strays=False,
    )
    kvb = st_b.pool_spec(PoolLayout("kv", "page_first", 64, (("bfloat16", (KVB // 2,)),), KVB))
    st_b.write([WriteItem(_k("c0"), kvb, [memoryview(bytearray(KVB))], prior="")])
    st_b.close()
    return root, st.mid, st_b.mid, chain


def _run(argv, capsys):
    rc = cli.main(argv)
    return rc, capsys.readouterr()


def test_stats_per_pool_model_and_coverage(populated, capsys):
    root, mid_a, mid_b, chain = populated
    rc, out = _run(["store", "--dir", str(root), "stats", "--json"], capsys)
    assert rc == 0
    st = json.loads(out.out)
    assert st["pages"] == 8
    models = {m["mid"]: m for m in st["models"]}
    a = models[mid_a]
    assert a["model"] == "org/model-a" and a["pools"]["kv"]["pages"] == 6 and a["pools"]["mamba"]["pages"] == 1
    assert a["pools"]["kv"]["bytes"] == 6 * (header_len_for(KVB) + KVB)
    cov = a["coverage"]
    assert cov["covered_pages"] == 2 and cov["kv_pages"] == 6  # chain[0..1] lie before the Mamba state
    assert cov["fraction"] == pytest.approx(2 / 6) and cov["exact"] is False and cov["unknown_links"] == 1
    assert models[mid_b]["shards"] == ["r1of2"] and models[mid_b]["coverage"]["fraction"] == 0
    rc, out = _run(["store", "--dir", str(root), "stats"], capsys)
    assert "restorable coverage 33.3%" in out.out and "org/model-a" in out.out


def test_coverage_exact_when_links_known():
    from sglang_l3.storage.format import PageName

    def e(key, pool, prior):
        return index.PageEntry(PageName(key, pool, "pd", "mid", "r0of1"), "", 100, 0.0, prior=prior)

    pages = [e("a", "kv", ""), e("b", "kv", "a"), e("c", "kv", "b"), e("d", "kv", "c"), e("b", "mamba", None)]
    cov = index.coverage(pages)["mid"]
    assert cov["exact"] and cov["covered_pages"] == 2 and cov["fraction"] == 0.5
    pages.append(e("d", "mamba", None))
    assert index.coverage(pages)["mid"]["fraction"] == 1.0


def test_ls_filters(populated, capsys):
    root, mid_a, mid_b, chain = populated
    rc, out = _run(["store", "--dir", str(root), "ls", "--json", "--limit", "0", "--model", "org/model-b"], capsys)
    rows = json.loads(out.out)
    assert len(rows) == 1 and rows[0]["model"] == mid_b
    rc, out = _run(["store", "--dir", str(root), "ls", "--json", "--pool", "mamba", "--model", mid_a[:6]], capsys)
    assert [r["key"] for r in json.loads(out.out)] == [chain[1]]


def test_verify_finds_and_quarantines(populated, capsys):
    root, mid_a, mid_b, chain = populated
    rc, out = _run(["store", "--dir", str(root), "verify"], capsys)
    assert rc == 0 and "0 bad" in out.out and "100.0%" in out.err  # progress bar on stderr
    victim = [f for f in os.listdir(root / "pages") if f.startswith(chain[2])][0]
    with open(root / "pages" / victim, "r+b") as f:
        f.seek(header_len_for(KVB) + 5)
        f.write(b"\xff\xfe")
    (root / "pages" / "junk.txt").write_text("x")
    rc, out = _run(["store", "--dir", str(root), "verify", "--no-quarantine"], capsys)
    assert rc == 1 and "checksum" in out.out and "stray" in out.out
    assert victim in os.listdir(root / "pages")
    rc, out = _run(["store", "--dir", str(root), "verify", "--quiet"], capsys)
    assert rc == 1 and victim not in os.listdir(root / "pages")
    q = os.listdir(root / "quarantine")
    assert any(victim in n and "-checksum-" in n for n in q) and any("junk.txt" in n for n in q)
    rc, out = _run(["store", "--dir", str(root), "stats", "--json"], capsys)
    assert json.loads(out.out)["quarantined"]["by_reason"] == {"checksum": 1, "stray": 1}


def test_evict_to_size_lru(populated, capsys):
    root, mid_a, mid_b, chain = populated
    pages = sorted(os.listdir(root / "pages"))
    for i, name in enumerate(pages):  # deterministic recency: later = newer
        os.utime(root / "pages" / name, (1000 + i, 1000 + i))
    keep = header_len_for(KVB) + KVB
    rc, out = _run(
        ["store", "--dir", str(root), "evict", "--yes", "--to", str(2 * keep + MB + header_len_for(MB))], capsys
    )
    assert rc == 0
    left = sorted(os.listdir(root / "pages"))
    total = sum(os.path.getsize(root / "pages" / n) for n in left)
    assert total <= 2 * keep + MB + header_len_for(MB)
    assert left == [n for n in pages if n in left] and pages[-1] in left  # newest survive


def test_clear_by_model_and_all(populated, capsys):
    root, mid_a, mid_b, chain = populated
    rc, out = _run(["store", "--dir", str(root), "clear", "--yes", "--model", "org/model-b"], capsys)
    assert rc == 0 and "removed 1 pages" in out.out
    assert all(mid_b not in n for n in os.listdir(root / "pages"))
    rc, out = _run(["store", "--dir", str(root), "clear", "--yes", "--model", "nope"], capsys)
    assert rc == 1
    rc, out = _run(["store", "--dir", str(root), "clear", "--yes"], capsys)
    assert rc == 0 and os.listdir(root / "pages") == []


def test_cli_refuses_destructive_ops_on_unsafe_dir(populated, capsys):
    root, *_ = populated
    os.chmod(root, 0o777)
    rc, out = _run(["store", "--dir", str(root), "clear"], capsys)
    assert rc == 2 and "chmod 700" in out.err
    assert len(os.listdir(root / "pages")) == 8
    os.chmod(root, 0o700)


def test_doctor_report(populated, tmp_path):
    root, *_ = populated
    r = doctor.report(str(root))
    assert r["ok"] and r["data"]["pages"] == 8 and r["data"]["safe"] and r["data"]["mode"] == "0700"
    assert any("8 pages" in line for line in r["lines"])
    os.chmod(root, 0o770)
    r = doctor.report(str(root))
    assert not r["ok"] and any("UNSAFE" in line for line in r["lines"])
    os.chmod(root, 0o700)
    r = doctor.report(str(tmp_path / "missing"))
    assert r["ok"] and r["data"]["exists"] is False


def test_cli_is_torch_free(tmp_path):
    code = (
        "import sys, sglang_l3.storage.cli, sglang_l3.storage.doctor, sglang_l3.storage.store;"
        "bad=[m for m in ('torch','sglang') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert r.returncode == 0, r.stdout + r.stderr
