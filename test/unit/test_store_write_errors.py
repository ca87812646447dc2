"""Issue 48 (second part): a page write that fails is counted, logged once per cause,
and retried, so the pages reach the store once the fault ends, without a flush.

The fault is the real one the issue saw: RLIMIT_FSIZE below a page file's size makes
every page write fail with EFBIG. It is set in a child process (the limit is
process-wide; the child reports over a pipe, which the limit does not cover), around
one `batch_set_v1` of the real store over a real upstream host pool; the child lifts it
again and waits, with nothing else calling the store, for the pages to appear.
Upstream's buffer-only pipeline takes every acknowledged write for stored and never
writes those pages again while it does, so the store's own retry is all that brings
them to L3 (without it they never come: the child's wait ends empty).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sglang_l3 import metrics
from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
from sglang_l3.storage.store import PageStore, PoolSpec, ReadItem, WriteItem

HERE = Path(__file__).resolve().parent
LIMIT = 10240  # bytes: a page file of the pool below is 32 KiB + its header

CHILD = r"""
import json, logging, resource, sys, time
import torch
from test_store_support import fill_random, keys, make_kv_pool, make_store, page_bytes, page_files, zero

root, limit = sys.argv[1], int(sys.argv[2])
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
kv = make_kv_pool(heads=4, head_dim=16, page_size=64, tokens=512)
fill_random(kv, 3)
st = make_store(root, kv=kv)
st.store.retry_first_s, st.store.retry_max_s = 0.05, 0.2  # the policy's shape, quicker
ks, idx = keys(4), torch.arange(0, 4 * 64, dtype=torch.int64)
want = [page_bytes(kv, i * 64) for i in range(4)]
out = {"file_len": st._specs["kv"].file_len}
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
try:
    out["during"] = st.batch_set_v1(ks, idx)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and st.counters().get("write_retries", 0) < 4:
        time.sleep(0.02)  # retries run (and fail) while the fault lasts
    out["fault_counters"] = st.counters()
    out["fault_files"] = page_files(root)
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
sys.stderr.write("--- fault lifted ---\n")
deadline = time.monotonic() + 120  # generous: a loaded machine; the retry waits 0.2 s at most
while time.monotonic() < deadline and (
    len(page_files(root)) < 4 or st.counters().get("write_retried_ok", 0) < 4
):
    time.sleep(0.05)
out["files"] = page_files(root)
zero(kv)
out["read"] = st.batch_get_v1(ks, idx)
out["same"] = [page_bytes(kv, i * 64) == want[i] for i in range(4)]
out["counters"] = st.counters()
st.close()
print(json.dumps(out))
"""


def _run_child(root: Path) -> tuple[dict, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(LIMIT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_failed_writes_are_counted_logged_once_and_land_after_the_fault(tmp_path: Path) -> None:
    out, log = _run_child(tmp_path / "store")
    assert out["file_len"] > LIMIT
    # during the fault: every write was attempted, failed, counted; nothing published
    assert out["during"] == [False] * 4
    fc = out["fault_counters"]
    assert fc.get("write_pages", 0) >= 4 and fc.get("write_errors", 0) >= 4, fc
    assert fc.get("write_ok", 0) == 0 and fc.get("api_errors", 0) == 0, fc
    assert out["fault_files"] == []
    # after the fault, with nothing else calling the store: the pages land, exact
    assert len(out["files"]) == 4, (out["files"], log[-3000:])
    assert out["read"] == [True] * 4 and out["same"] == [True] * 4
    c = out["counters"]
    assert c.get("write_retried_ok", 0) == 4, c
    assert c.get("write_retry_dropped", 0) == 0, c
    assert c.get("write_errors", 0) >= 4 and c.get("write_ok", 0) == 4, c
    # logged once for the cause (EFBIG), not once per page or per retry; once when it ends
    during, _, after = log.partition("--- fault lifted ---")
    failures = [ln for ln in during.splitlines() if "sglang-l3 store: write of" in ln]
    assert len(failures) == 1, during[-3000:]
    assert "File too large" in failures[0]
    assert sum("page writes succeed again" in ln for ln in after.splitlines()) == 1, after[-3000:]


# --------------------------------------------------------------------------- #
# In-process: an injected EIO (a test-only fault: os.pwritev raises while patched)
# --------------------------------------------------------------------------- #
PAGE = 64 << 10


def _store(root: Path) -> tuple[PageStore, PoolSpec]:
    st = PageStore(
        StoreSettings(root=str(root), min_free="0"), ModelIdentity(model="werr"), Shard(), sweep_strays=False
    )
    st.retry_first_s, st.retry_max_s = 0.05, 0.1
    return st, st.pool_spec(PoolLayout("kv", "raw", 1, (("uint8", (PAGE,)),), PAGE))


def _items(spec: PoolSpec, n: int, tag: str) -> list[WriteItem]:
    out = []
    for i in range(n):
        key = hashlib.sha256(f"{tag}-{i}".encode()).hexdigest()
        out.append(WriteItem(key, spec, [memoryview(bytearray(bytes.fromhex(key) * (PAGE // 32)))]))
    return out


def _wait(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_retries_are_bounded_by_bytes_and_pending_pages_go_with_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    st, spec = _store(tmp_path)
    st.retry_max_bytes = 2 * PAGE  # two failed pages held for a retry, no more
    items = _items(spec, 3, "a")

    def eio(*_a: object) -> int:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "pwritev", eio)
    with caplog.at_level(logging.WARNING, logger="sglang_l3.storage.store"):
        assert st.write(items) == [False] * 3
        _wait(lambda: st.counters.get("write_retries") >= 4, "retries run (and fail) while the fault lasts")
    c = st.counters.snapshot()
    assert c["write_errors"] >= 3 + 4 and c["write_retry_dropped"] == 1, c  # the third page: over the bytes
    warned = [r.getMessage() for r in caplog.records if "write of" in r.getMessage()]
    assert len(warned) == 2, warned  # one per cause: EIO, the full retry budget
    assert st.retry_pending() == 2
    monkeypatch.undo()
    _wait(lambda: st.counters.get("write_retried_ok") == 2, "the two held pages land")
    assert st.exists([(it.key, spec) for it in items]) == [True, True, False]
    got = [bytearray(PAGE) for _ in range(2)]
    assert st.read([ReadItem(it.key, spec, [memoryview(b)]) for it, b in zip(items, got, strict=False)]) == [True] * 2
    assert [bytes(b) for b in got] == [bytes(it.runs[0]) for it in items[:2]]

    # a page still failing when the store closes is dropped with it, counted
    monkeypatch.setattr(os, "pwritev", eio)
    assert st.write(_items(spec, 1, "b")) == [False]
    st.close()
    assert st.counters.get("write_retry_dropped") == 2


def test_a_failing_session_table_never_delays_page_writes_and_is_written_once_it_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang_l3.storage import sessions as table

    st, spec = _store(tmp_path)
    st.sessions.table_retry_s = 0.05  # the policy's shape, quicker
    before = metrics.get("session_table_errors")
    tries = []

    def efbig(*_a: object) -> None:
        tries.append(1)
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(table, "replace_table_bytes", efbig)
    items = _items(spec, 4, "s")
    with caplog.at_level(logging.WARNING, logger="sglang_l3.storage.retention"):
        st.sessions.on_turn("agent-1", [it.key for it in items[:2]], 2 * 64)
        _wait(lambda: len(tries) >= 1, "the session table was never tried")
        st.sessions.on_turn("agent-1", [it.key for it in items], 4 * 64)  # a change: tried again
        _wait(lambda: len(tries) >= 3, "the table is tried again while it fails")
        assert metrics.get("session_table_errors") - before >= 3
        assert st.write(items) == [True] * 4  # at once, in the caller: nothing waits on the table
        assert st.counters.get("write_ok") == 4 and st.counters.get("write_errors") == 0
        monkeypatch.undo()  # the fault ends; no session changes from here on
        _wait(lambda: [r.id for r in table.load(st.dirs, st.mid)[0]] == ["agent-1"], "the table written again")
        # the writer logs just after its replace lands: wait for the line, not only the file
        _wait(lambda: any("written again" in r.getMessage() for r in caplog.records), "the recovery logged")
    lines = [r.getMessage() for r in caplog.records]
    assert sum("cannot write the session table" in m for m in lines) == 1, lines  # once for EFBIG
    assert sum("the session table is written again" in m for m in lines) == 1, lines
    assert table.load(st.dirs, st.mid)[0][0].keys == [it.key for it in items]
    st.close()
