"""Bounded: byte cap and free-space floor with LRU eviction; a full disk
drops the write, counts it, and serving continues."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
from test_store_support import fill_random, keys, make_kv_pool, make_store, page_bytes, page_files, zero


def _idx(n, ps, start=0):
    return torch.arange(start * ps, (start + n) * ps, dtype=torch.int64)


def _dir_bytes(root):
    d = os.path.join(str(root), "pages")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def test_cap_evicts_least_recently_used(tmp_path):
    kv = make_kv_pool()
    fill_random(kv, 1)
    probe = make_store(tmp_path / "probe", kv=kv)
    file_len = probe._specs["kv"].file_len
    probe.close()
    cap = 10 * file_len
    st = make_store(tmp_path / "s", kv=kv, extra={"max_bytes": cap})
    ks = keys(30)
    assert all(st.batch_set_v1(ks[:8], _idx(8, 4)))
    for i in range(8, 30, 2):
        assert st.batch_get_v1(ks[:1], _idx(1, 4, 10)) == [True]  # page 0 stays hot
        assert st.batch_set_v1(ks[i : i + 2], _idx(2, 4)) == [True, True]
        assert _dir_bytes(tmp_path / "s") <= cap
    c = st.counters()
    assert c["evicted"] >= 20
    assert st.exists(ks[0]), "recently read page must survive LRU eviction"
    assert not st.exists(ks[1])
    assert st.exists(ks[29])
    st.close()


def test_cap_is_split_across_tp_ranks(tmp_path):
    kv = make_kv_pool()
    st = make_store(tmp_path, kv=kv, tp_rank=1, tp_size=2, extra={"max_bytes": "1Mi"})
    assert st.store.max_bytes_rank == (1 << 20) // 2
    st.close()


def test_enospc_from_allocation_drops_and_serving_continues(tmp_path, monkeypatch):
    kv = make_kv_pool()
    fill_random(kv, 2)
    st = make_store(tmp_path, kv=kv)
    ks = keys(6)
    assert all(st.batch_set_v1(ks[:3], _idx(3, 4)))
    want = [page_bytes(kv, i * 4) for i in range(3)]
    real = os.posix_fallocate

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert st.batch_set_v1(ks[3:], _idx(3, 4, 3)) == [False] * 3
    assert st.counters()["write_enospc"] == 3
    assert os.listdir(tmp_path / "tmp") == []
    zero(kv)
    assert st.batch_get_v1(ks[:3], _idx(3, 4, 8)) == [True] * 3  # reads unaffected
    assert [page_bytes(kv, (8 + i) * 4) for i in range(3)] == want
    monkeypatch.setattr(os, "posix_fallocate", real)
    assert all(st.batch_set_v1(ks[3:], _idx(3, 4, 3)))  # space is back
    st.close()


def test_enospc_mid_write_leaves_nothing(tmp_path, monkeypatch):
    kv = make_kv_pool()
    st = make_store(tmp_path, kv=kv)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    assert st.batch_set_v1(keys(2), _idx(2, 4)) == [False, False]
    assert st.counters()["write_enospc"] == 2
    assert page_files(tmp_path) == [] and os.listdir(tmp_path / "tmp") == []
    st.close()


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_filesystem(tiny_fs):
    kv = make_kv_pool(heads=4, head_dim=64, tokens=512)  # 16 KiB pages, 20 KiB files
    fill_random(kv, 3)
    st = make_store(tiny_fs / "store", kv=kv)
    ks = keys(100)
    ok = []
    for i in range(0, 100, 10):
        ok += st.batch_set_v1(ks[i : i + 10], _idx(10, 4, i % 100))
    assert 10 < sum(ok) < 100
    c = st.counters()
    assert c["write_enospc"] == 100 - sum(ok)
    assert os.listdir(tiny_fs / "store" / "tmp") == []
    good = [k for k, o in zip(ks, ok, strict=True) if o]
    assert all(st.batch_get_v1(good[:10], _idx(10, 4, 100)))
    st.close()


def test_free_space_floor_evicts_instead_of_filling(tiny_fs):
    kv = make_kv_pool(heads=4, head_dim=64, tokens=512)
    fill_random(kv, 4)
    st = make_store(tiny_fs / "store", kv=kv, extra={"min_free_bytes": "400Ki"})
    ks = keys(100)
    for i in range(0, 100, 10):
        assert all(st.batch_set_v1(ks[i : i + 10], _idx(10, 4, i % 100)))
        assert os.statvfs(tiny_fs).f_bavail * os.statvfs(tiny_fs).f_frsize >= 400 * 1024 - 24 * 1024
    c = st.counters()
    assert c["evicted"] > 0 and c.get("write_enospc", 0) == 0
    st.close()
