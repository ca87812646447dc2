"""Every kind of bad page is a miss + quarantine + counter, never an exception
and never wrong KV; the page is rewritten by the next write."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_l3.storage.format import header_len_for
from test_store_support import (
    fill_random,
    keys,
    make_kv_pool,
    make_mamba_pool,
    make_store,
    page_bytes,
    page_files,
    quarantine_files,
    zero,
)


def _idx(n, ps, start=0):
    return torch.arange(start * ps, (start + n) * ps, dtype=torch.int64)


@pytest.fixture
def written(tmp_path):
    kv = make_kv_pool()
    fill_random(kv, 1)
    st = make_store(tmp_path, kv=kv)
    ks = keys(4)
    assert all(st.batch_set_v1(ks, _idx(4, kv.page_size)))
    want = [page_bytes(kv, i * kv.page_size) for i in range(4)]
    yield st, kv, ks, want, tmp_path
    st.close()


def _path(st, key, pool="kv"):
    return st.store.path_of(key, st._specs[pool])


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _assert_miss_quarantined(st, kv, ks, want, root, bad: int, reason: str):
    zero(kv)
    res = st.batch_get_v1(ks, _idx(4, kv.page_size, 8))
    assert res == [i != bad for i in range(4)]
    for i in range(4):
        if i != bad:
            assert page_bytes(kv, (8 + i) * kv.page_size) == want[i]
    c = st.counters()
    assert c.get(f"quarantined_{reason}") == 1 and c["quarantined"] == 1, c
    assert not os.path.exists(_path(st, ks[bad]))
    q = quarantine_files(root)
    assert len(q) == 1 and f"-{reason}-" in q[0] and ks[bad] in q[0]
    # Self-healing: the slot is free, the next write lands and reads back.
    fill_random(kv, 1)
    assert st.batch_set_v1([ks[bad]], _idx(1, kv.page_size, bad)) == [True]
    zero(kv)
    assert st.batch_get_v1([ks[bad]], _idx(1, kv.page_size, 9)) == [True]
    assert page_bytes(kv, 9 * kv.page_size) == want[bad]


def test_payload_bit_flip(written):
    st, kv, ks, want, root = written
    p = _path(st, ks[1])
    _flip(p, header_len_for(len(want[1])) + 17)
    _assert_miss_quarantined(st, kv, ks, want, root, 1, "checksum")


def test_header_bit_flip_in_metadata(written):
    st, kv, ks, want, root = written
    _flip(_path(st, ks[2]), 60)  # inside the JSON metadata
    _assert_miss_quarantined(st, kv, ks, want, root, 2, "header_checksum")


def test_header_bit_flip_in_magic(written):
    st, kv, ks, want, root = written
    _flip(_path(st, ks[0]), 3)
    _assert_miss_quarantined(st, kv, ks, want, root, 0, "magic")


def test_truncated_file(written):
    st, kv, ks, want, root = written
    p = _path(st, ks[3])
    os.truncate(p, os.path.getsize(p) - 100)
    _assert_miss_quarantined(st, kv, ks, want, root, 3, "size")


def test_zero_length_file(written):
    st, kv, ks, want, root = written
    os.truncate(_path(st, ks[1]), 0)
    _assert_miss_quarantined(st, kv, ks, want, root, 1, "size")


def test_truncated_page_is_not_promised_by_exists(written):
    """#39147 residual: a damaged page must shrink the hit at query time."""
    st, kv, ks, want, root = written
    os.truncate(_path(st, ks[2]), 10)
    assert st.batch_exists_v2(ks).kv_hit_pages == 2
    assert st.counters()["quarantined_size"] == 1


def test_swapped_page_of_another_key(written):
    st, kv, ks, want, root = written
    shutil.copyfile(_path(st, ks[0]), _path(st, ks[1]))  # same size, valid header, wrong key
    _assert_miss_quarantined(st, kv, ks, want, root, 1, "identity")


def test_stray_file_with_a_page_name(written):
    st, kv, ks, want, root = written
    p = _path(st, ks[2])
    size = os.path.getsize(p)
    with open(p, "wb") as f:
        f.write(os.urandom(size))
    _assert_miss_quarantined(st, kv, ks, want, root, 2, "magic")


def test_stray_non_page_file_is_swept(tmp_path):
    from sglang_l3.storage import store as store_mod

    os.makedirs(tmp_path / "pages", mode=0o700)
    os.chmod(tmp_path, 0o700)
    (tmp_path / "pages" / "notes.txt").write_text("hello")
    (tmp_path / "pages" / "abc_model_0_1.bin").write_bytes(b"\0" * 64)  # upstream-style name
    old = store_mod._STRAY_MIN_AGE_S
    store_mod._STRAY_MIN_AGE_S = -1
    try:
        st = make_store(tmp_path, kv=make_kv_pool())
        for _ in range(100):
            if len(quarantine_files(tmp_path)) == 2:
                break
            import time

            time.sleep(0.05)
    finally:
        store_mod._STRAY_MIN_AGE_S = old
    assert page_files(tmp_path) == []
    assert all("-stray-" in q for q in quarantine_files(tmp_path))
    assert st.counters()["quarantined_stray"] == 2
    st.close()


@pytest.mark.parametrize(
    "other",
    [
        dict(model="other/model"),  # another model
        dict(tp_size=2),  # another TP size
        dict(dtype=torch.float16),  # another KV dtype (same bytes per page)
    ],
)
def test_page_from_another_identity(tmp_path, other):
    """A foreign page placed at our path (copied, renamed, restored from a
    backup) is detected by the header: a bf16 page is never read as fp16."""
    dtype = other.pop("dtype", torch.bfloat16)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    kv_a = make_kv_pool(dtype=dtype)
    fill_random(kv_a, 3)
    st_a = make_store(a_dir, kv=kv_a, **other)
    ks = keys(1)
    assert st_a.batch_set_v1(ks, _idx(1, 4)) == [True]
    kv_b = make_kv_pool()
    st_b = make_store(b_dir, kv=kv_b)
    # Different identity -> different file name: a shared directory just misses.
    assert os.path.basename(_path(st_a, ks[0])) != os.path.basename(_path(st_b, ks[0]))
    shutil.copyfile(_path(st_a, ks[0]), _path(st_b, ks[0]))
    zero(kv_b)
    assert st_b.batch_get_v1(ks, _idx(1, 4, 2)) == [False]
    c = st_b.counters()
    assert c["quarantined_identity"] == 1
    assert len(quarantine_files(b_dir)) == 1
    st_a.close()
    st_b.close()


def test_bf16_store_read_by_fp16_reader_in_one_directory_is_a_miss(tmp_path):
    kv16 = make_kv_pool(dtype=torch.bfloat16)
    fill_random(kv16, 4)
    w = make_store(tmp_path, kv=kv16)
    ks = keys(2)
    assert all(w.batch_set_v1(ks, _idx(2, 4)))
    kvf = make_kv_pool(dtype=torch.float16)
    r = make_store(tmp_path, kv=kvf)
    assert r.batch_exists(ks) == 0
    assert r.batch_get_v1(ks, _idx(2, 4)) == [False, False]
    w.close()
    r.close()


def test_corrupt_mamba_state_misses_without_touching_kv(tmp_path):
    kv, mb = make_kv_pool(), make_mamba_pool()
    fill_random(kv, 5)
    fill_random(mb, 6)
    st = make_store(tmp_path, kv=kv, mamba=mb)
    ks = keys(3)
    tr = lambda idx: [  # noqa: E731
        PoolTransfer(name=PoolName.KV, host_indices=_idx(3, 4, idx), keys=ks),
        PoolTransfer(
            name=PoolName.MAMBA,
            host_indices=torch.tensor([idx]),
            keys=[ks[-1]],
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        ),
    ]
    st.batch_set_v2(tr(0))
    mp = _path(st, ks[-1], "mamba")
    _flip(mp, os.path.getsize(mp) - 1)
    res = st.batch_get_v2(tr(4))
    assert res[PoolName.KV] == [True] * 3 and res[PoolName.MAMBA] == [False]
    assert st.counters()["quarantined_checksum"] == 1
    # And the existence query no longer promises the state.
    r = st.batch_exists_v2(
        ks, [PoolTransfer(name=PoolName.MAMBA, keys=[ks[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    )
    assert r.kv_hit_pages == 0 and r.restorable_prefix_pages == []
    st.close()


def test_internal_errors_are_misses_not_exceptions(written, monkeypatch):
    st, kv, ks, want, root = written

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(st.store, "read", boom)
    monkeypatch.setattr(st.store, "write", boom)
    monkeypatch.setattr(st.store, "exists", boom)
    assert st.batch_get_v1(ks, _idx(4, 4)) == [False] * 4
    assert st.batch_set_v1(ks, _idx(4, 4)) == [False] * 4
    assert st.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=_idx(4, 4), keys=ks)]) == {
        PoolName.KV: [False] * 4
    }
    assert st.batch_exists_v2(ks).kv_hit_pages == 0
    assert st.batch_exists(ks) == 0 and st.exists(ks[0]) is False
    assert st.counters()["api_errors"] == 6


def test_invalid_keys_cannot_escape_the_directory(written):
    st, kv, ks, want, root = written
    bad = ["../../etc/passwd", "/abs", "a/b", "..", "", "x" * 200, "k.with.dots"]
    assert st.batch_set_v1(bad, _idx(len(bad), 4)) == [False] * len(bad)
    assert st.batch_get_v1(bad, _idx(len(bad), 4)) == [False] * len(bad)
    assert st.batch_exists(bad) == 0
    assert st.counters()["invalid_keys"] >= 3 * len(bad) - 2
    assert len(page_files(root)) == 4 and not os.path.exists(root.parent / "etc")
