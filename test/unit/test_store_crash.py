"""A writer killed with SIGKILL mid-write never leaves a page that reads as
valid but is partial: every page file present reads back exactly, or misses."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest
from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
from sglang_l3.storage.store import PageStore, ReadItem

PAGE = 12 << 20  # 3 checksum blocks: a kill lands inside a page most of the time

WRITER = r"""
import hashlib, sys
from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
from sglang_l3.storage.store import PageStore, WriteItem
root, durability, page = sys.argv[1], sys.argv[2], int(sys.argv[3])
st = PageStore(StoreSettings(root=root, min_free="0", durability=durability, io_threads=4),
               ModelIdentity(model="crash"), Shard(), sweep_strays=False)
spec = st.pool_spec(PoolLayout("kv", "raw", 1, (("uint8", (page,)),), page))
i = 0
print("ready", flush=True)
while True:
    batch = []
    for _ in range(3):
        key = hashlib.sha256(str(i).encode()).hexdigest(); i += 1
        data = bytearray(bytes.fromhex(key) * (page // 32))
        batch.append(WriteItem(key, spec, [memoryview(data)]))
    st.write(batch)
    print(i, flush=True)
"""


def _open(root):
    st = PageStore(StoreSettings(root=root, min_free="0"), ModelIdentity(model="crash"), Shard(), sweep_strays=False)
    return st, st.pool_spec(PoolLayout("kv", "raw", 1, (("uint8", (PAGE,)),), PAGE))


@pytest.mark.parametrize("durability", ["none", "batch"])
def test_kill9_mid_write_leaves_no_readable_partial_page(tmp_path, durability):
    root = tmp_path / "store"
    leftovers = 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # four kills; on a busy machine (the writer starved between batches) up to 16 until one lands in a write
    for attempt in range(16):
        p = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), durability, str(PAGE)], stdout=subprocess.PIPE, env=env
        )
        assert p.stdout.readline().strip() == b"ready"
        p.stdout.readline()  # at least one batch landed
        time.sleep(0.05 + 0.07 * (attempt % 4))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        last = len(os.listdir(root / "tmp"))  # the next start-up cleans them
        leftovers += last
        if attempt >= 3 and leftovers:
            break
    assert leftovers > 0, "the kills never landed inside a write; the test proved nothing"

    st, spec = _open(root)
    assert os.listdir(root / "tmp") == [], "a dead writer's temporary files are removed at start-up"
    assert st.counters.get("tmp_cleaned") == last
    names = os.listdir(root / "pages")
    assert names
    buf = bytearray(PAGE)
    for name in names:
        key = name.split(".", 1)[0]
        assert st.read([ReadItem(key, spec, [memoryview(buf)])]) == [True], name
        assert bytes(buf) == bytes.fromhex(key) * (PAGE // 32), f"{name} read as valid but differs"
    assert st.counters.get("quarantined") == 0
    st.close()


def test_a_live_writers_tmp_files_survive_another_ranks_start_up(tmp_path):
    st, _ = _open(tmp_path)
    live = tmp_path / "tmp" / f"{os.getppid()}-abc.tmp"  # a live process (our parent)
    dead = tmp_path / "tmp" / "999999999-abc.tmp"
    live.write_bytes(b"x")
    dead.write_bytes(b"x")
    st2, _ = _open(tmp_path)
    assert live.exists() and not dead.exists()
    st.close()
    st2.close()


def test_torn_page_after_power_loss_is_a_miss(tmp_path):
    """Without fsync a crash can leave a renamed page whose blocks never hit
    the disk (zeros): the checksum catches it."""
    from sglang_l3.storage.format import header_len_for
    from sglang_l3.storage.store import WriteItem

    st, spec = _open(tmp_path)
    key = hashlib.sha256(b"x").hexdigest()
    data = bytearray(os.urandom(PAGE))
    assert st.write([WriteItem(key, spec, [memoryview(data)])]) == [True]
    path = st.path_of(key, spec)
    with open(path, "r+b") as f:  # the last block never made it
        f.seek(header_len_for(PAGE) + PAGE - (1 << 20))
        f.write(bytes(1 << 20))
    out = bytearray(PAGE)
    assert st.read([ReadItem(key, spec, [memoryview(out)])]) == [False]
    assert st.counters.get("quarantined_checksum") == 1
    st.close()


RANK = r"""
import hashlib, sys
from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
from sglang_l3.storage.store import PageStore, ReadItem, WriteItem
root, rank = sys.argv[1], int(sys.argv[2])
st = PageStore(StoreSettings(root=root, min_free="0", durability="batch"),
               ModelIdentity(model="tp", tp_size=2), Shard(tp_rank=rank, tp_size=2))
spec = st.pool_spec(PoolLayout("kv", "raw", 1, (("uint8", (65536,)),), 65536))
keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(40)]
data = lambda k: bytes([rank + 1]) * 32768 + bytes.fromhex(k) * 1024
for i in range(0, 40, 8):
    assert all(st.write([WriteItem(k, spec, [memoryview(bytearray(data(k)))]) for k in keys[i:i + 8]]))
buf = bytearray(65536)
for k in keys:
    assert st.read([ReadItem(k, spec, [memoryview(buf)])]) == [True] and bytes(buf) == data(k), k
assert st.counters.get("quarantined") == 0
print("ok", flush=True)
"""


def test_two_rank_processes_share_a_directory(tmp_path):
    """TP=2: both ranks start, write and read concurrently on one directory."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    ps = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(tmp_path), str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in ps]
    for p, (out, err) in zip(ps, outs, strict=True):
        assert p.returncode == 0 and out.strip() == b"ok", err.decode()[-2000:]
    names = os.listdir(tmp_path / "pages")
    assert len(names) == 80 and sum(".r0of2." in n for n in names) == 40
