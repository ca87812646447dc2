"""Round trips through L3FileStore for every pool kind and layout, against
real upstream host pools on CPU; the bytes on disk are upstream's flat page."""

from __future__ import annotations

import os

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang_l3.storage.format import decode_header, header_len_for
from test_store_support import (
    fill_random,
    keys,
    make_kv_pool,
    make_mamba_pool,
    make_store,
    page_bytes,
    page_files,
    zero,
)


def _idx(pages, page_size, start_page=0):
    return torch.arange(start_page * page_size, (start_page + pages) * page_size, dtype=torch.int64)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first", "page_head"])
def test_kv_v1_round_trip_every_layout(tmp_path, layout):
    kv = make_kv_pool(layout)
    fill_random(kv, seed=1)
    st = make_store(tmp_path, kv=kv)
    assert isinstance(st, HiCacheStorage)
    assert st._maps["kv"].zero_copy, "host pool pages should be written straight from pool memory"
    ps, ks = kv.page_size, keys(5)
    want = [page_bytes(kv, i * ps) for i in range(5)]
    assert st.batch_set_v1(ks, _idx(5, ps)) == [True] * 5
    assert len(page_files(tmp_path)) == 5
    # Payload on disk == upstream's flat page bytes (the format only adds a header).
    name = [f for f in page_files(tmp_path) if f.startswith(ks[2])][0]
    raw = (tmp_path / "pages" / name).read_bytes()
    hlen = header_len_for(len(want[2]))
    assert raw[hlen:] == want[2]
    h = decode_header(raw[:hlen], len(raw))
    assert h.meta["key"] == ks[2] and h.meta["pool"] == "kv"
    assert h.meta["pool_layout"]["layout"] == layout
    assert h.meta["pool_layout"]["components"][0][0] == "bfloat16"
    # Read back into different host slots.
    zero(kv)
    assert st.batch_get_v1(ks, _idx(5, ps, start_page=7)) == [True] * 5
    for i in range(5):
        assert page_bytes(kv, (7 + i) * ps) == want[i]
    assert st.batch_exists(ks) == 5
    assert st.batch_exists(ks[:3] + keys(1, "other")) == 3
    st.close()


def test_kv_and_mamba_v2_round_trip(tmp_path):
    kv, mb = make_kv_pool(), make_mamba_pool()
    fill_random(kv, 2)
    fill_random(mb, 3)
    st = make_store(tmp_path, kv=kv, mamba=mb)
    assert st._maps["mamba"].zero_copy
    ps, ks = kv.page_size, keys(4)
    kv_want = [page_bytes(kv, i * ps) for i in range(4)]
    mb_want = page_bytes(mb, 5)
    res = st.batch_set_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=_idx(4, ps), keys=ks),
            PoolTransfer(
                name=PoolName.MAMBA,
                host_indices=torch.tensor([5]),
                keys=[ks[-1]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ],
        HiCacheStorageExtraInfo(prefix_keys=[]),
    )
    assert res[PoolName.KV] == [True] * 4 and res[PoolName.MAMBA] == [True]
    zero(kv)
    zero(mb)
    res = st.batch_get_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=_idx(4, ps, 3), keys=ks),
            PoolTransfer(
                name=PoolName.MAMBA,
                host_indices=torch.tensor([1]),
                keys=[ks[-1]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            ),
        ]
    )
    assert res[PoolName.KV] == [True] * 4 and res[PoolName.MAMBA] == [True]
    assert [page_bytes(kv, (3 + i) * ps) for i in range(4)] == kv_want
    assert page_bytes(mb, 1) == mb_want
    # Chain link recorded from prefix_keys (for restorable coverage).
    from sglang_l3.storage.index import scan

    ents = {(e.name.key, e.name.pool): e for e in scan(str(tmp_path), headers=True).pages}
    assert ents[(ks[0], "kv")].prior == "" and ents[(ks[0], "kv")].depth == 0
    assert ents[(ks[2], "kv")].prior == ks[1] and ents[(ks[2], "kv")].depth == 2
    st.close()


def test_batch_exists_v2_policies(tmp_path):
    kv, mb = make_kv_pool(), make_mamba_pool()
    fill_random(kv, 4)
    fill_random(mb, 5)
    st = make_store(tmp_path, kv=kv, mamba=mb)
    ps, ks = kv.page_size, keys(6)
    st.batch_set_v1(ks, _idx(6, ps))
    # Mamba states at pages 2 and 4 (1-based prefix lengths), like chunk checkpoints.
    for p in (2, 4):
        st.batch_set_v2(
            [
                PoolTransfer(
                    name=PoolName.MAMBA,
                    host_indices=torch.tensor([p]),
                    keys=[ks[p - 1]],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                )
            ]
        )
    trailing = PoolTransfer(name=PoolName.MAMBA, keys=[ks[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    r = st.batch_exists_v2(ks, [trailing])
    assert r.kv_hit_pages == 4 and r.restorable_prefix_pages == [2, 4]
    assert r.extra_pool_hit_pages[PoolName.KV] == 6 and r.extra_pool_hit_pages[PoolName.MAMBA] == 4
    # ALL_PAGES pool: every page must exist.
    allp = PoolTransfer(name=PoolName.MAMBA, keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert st.batch_exists_v2(ks, [allp]).kv_hit_pages == 0
    # KV gap stops the prefix.
    os.unlink(st.store.path_of(ks[3], st._specs["kv"]))
    r = st.batch_exists_v2(ks, [trailing])
    assert r.kv_hit_pages == 2 and r.restorable_prefix_pages == [2]
    # Unsupported / unregistered pools never over-promise.
    unk = PoolTransfer(name=PoolName.SWA, keys=[ks[0]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert st.batch_exists_v2(ks, [unk]).kv_hit_pages == 0
    blk = PoolTransfer(name=PoolName.MAMBA, keys=[ks[0]], hit_policy=PoolHitPolicy.BLOCK_GROUPS)
    assert st.batch_exists_v2(ks, [blk]).kv_hit_pages == 0
    st.close()


def test_legacy_get_set_share_files_with_v1(tmp_path):
    kv = make_kv_pool()
    fill_random(kv, 6)
    st = make_store(tmp_path, kv=kv)
    ks = keys(2)
    page = kv.get_data_page(0, flat=True).contiguous().clone()
    assert st.set(ks[0], page)
    assert st.exists(ks[0]) and not st.exists(ks[1])
    out = kv.get_dummy_flat_data_page()
    assert st.get(ks[0], out) is out and torch.equal(out.view(torch.uint8), page.view(torch.uint8))
    zero(kv)
    assert st.batch_get_v1([ks[0]], _idx(1, kv.page_size, 2)) == [True]
    assert torch.equal(kv.get_data_page(2 * kv.page_size, flat=True).view(torch.uint8), page.view(torch.uint8))
    assert st.batch_get(ks, [kv.get_dummy_flat_data_page() for _ in ks])[1] is None
    st.close()


def test_tp2_ranks_share_one_directory(tmp_path):
    kvs = [make_kv_pool(), make_kv_pool()]
    mbs = [make_mamba_pool(), make_mamba_pool()]
    for r in range(2):
        fill_random(kvs[r], 10 + r)
        fill_random(mbs[r], 20 + r)
    sts = [make_store(tmp_path, kv=kvs[r], mamba=mbs[r], tp_rank=r, tp_size=2) for r in range(2)]
    ks = keys(3)
    want = [[page_bytes(kvs[r], i * 4) for i in range(3)] for r in range(2)]
    mwant = [page_bytes(mbs[r], 0) for r in range(2)]
    for r in range(2):
        assert sts[r].batch_set_v2(
            [
                PoolTransfer(name=PoolName.KV, host_indices=_idx(3, 4), keys=ks),
                PoolTransfer(
                    name=PoolName.MAMBA,
                    host_indices=torch.tensor([0]),
                    keys=[ks[-1]],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                ),
            ]
        )[PoolName.MAMBA] == [True]
    files = page_files(tmp_path)
    assert len(files) == 8 and sum("r0of2" in f for f in files) == 4 and sum("r1of2" in f for f in files) == 4
    for r in range(2):
        zero(kvs[r])
        zero(mbs[r])
        res = sts[r].batch_get_v2(
            [
                PoolTransfer(name=PoolName.KV, host_indices=_idx(3, 4, 5), keys=ks),
                PoolTransfer(
                    name=PoolName.MAMBA,
                    host_indices=torch.tensor([3]),
                    keys=[ks[-1]],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                ),
            ]
        )
        assert res[PoolName.KV] == [True] * 3 and res[PoolName.MAMBA] == [True]
        assert [page_bytes(kvs[r], (5 + i) * 4) for i in range(3)] == want[r]
        assert page_bytes(mbs[r], 3) == mwant[r]
    for s in sts:
        s.close()


def test_copy_path_for_pools_without_page_views(tmp_path):
    """A pool whose get_data_page returns copies still round-trips (copy path)."""
    kv = make_kv_pool()
    fill_random(kv, 7)

    class CopyingPool:
        page_size, layout, size = kv.page_size, "opaque", kv.size

        def get_data_page(self, index, flat=True):
            return kv.get_data_page(index, flat=True).clone()

        def get_dummy_flat_data_page(self):
            return kv.get_dummy_flat_data_page()

        def set_from_flat_data_page(self, index, data):
            kv.set_from_flat_data_page(index, data)

    st = make_store(tmp_path)
    st.register_mem_pool_host(CopyingPool())
    assert not st._maps["kv"].zero_copy
    want = page_bytes(kv, 4)
    assert st.batch_set_v1(keys(1), _idx(1, 4, 1)) == [True]
    zero(kv)
    assert st.batch_get_v1(keys(1), _idx(1, 4, 6)) == [True]
    assert page_bytes(kv, 24) == want
    st.close()


@pytest.mark.parametrize("durability,odirect", [("batch", "on"), ("none", "off")])
def test_io_modes_round_trip(tmp_path, durability, odirect):
    # 4096-byte-multiple pages (2 layers x 4 heads x 64 dim x 2 B x 4 tokens x 2 = 16 KiB)
    kv = make_kv_pool(heads=4, head_dim=64, tokens=256)
    fill_random(kv, 8)
    st = make_store(tmp_path, kv=kv, extra={"durability": durability, "odirect": odirect})
    ks = keys(16)
    want = [page_bytes(kv, i * 4) for i in range(16)]
    assert all(st.batch_set_v1(ks, _idx(16, 4)))
    zero(kv)
    assert all(st.batch_get_v1(ks, _idx(16, 4, 20)))
    assert [page_bytes(kv, (20 + i) * 4) for i in range(16)] == want
    c = st.counters()
    assert c["read_hits"] == 16 and c["write_ok"] == 16
    st.close()


def test_counters_count_every_page_of_a_batch(tmp_path):
    """A batch's totals (the store adds them up per batch): pages asked, hits, bytes and
    missing pages of a read that misses two of six; pages, successes and bytes of a write;
    no direct IO with odirect off, no errors."""
    kv = make_kv_pool(heads=4, head_dim=64, tokens=256)
    fill_random(kv, 9)
    st = make_store(tmp_path, kv=kv, extra={"odirect": "off"})
    ks = keys(6)
    assert st.batch_set_v1(ks[:4], _idx(4, 4)) == [True] * 4
    page = 2 * 4 * 64 * 2 * 4 * 2  # layers x heads x dim x 2 B x 4 tokens x (K, V)
    c = st.counters()
    assert (c["write_pages"], c["write_ok"], c["write_bytes"]) == (4, 4, 4 * page)
    assert c.get("write_direct", 0) == 0 and c.get("write_errors", 0) == 0
    assert st.batch_get_v1(ks, _idx(6, 4, 20)) == [True] * 4 + [False] * 2
    c = st.counters()
    assert (c["read_pages"], c["read_hits"], c["read_bytes"], c["read_missing"]) == (6, 4, 4 * page, 2)
    assert c.get("read_direct", 0) == 0 and c.get("read_errors", 0) == 0
    st.close()


def test_direct_io_used_when_host_memory_is_aligned(tmp_path):
    """O_DIRECT needs 4 KiB-aligned buffers: page-aligned host memory takes it."""
    import mmap

    from sglang_l3.storage.config import StoreSettings
    from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
    from sglang_l3.storage.store import PageStore, ReadItem, WriteItem

    ps = PageStore(StoreSettings(root=tmp_path, min_free="0", odirect="on"), ModelIdentity(model="m"), Shard())
    if not ps.odirect:
        pytest.skip("filesystem refuses O_DIRECT")
    spec = ps.pool_spec(PoolLayout("kv", "raw", 1, (("uint8", (1 << 20,)),), 1 << 20))
    src, dst = mmap.mmap(-1, 1 << 20), mmap.mmap(-1, 1 << 20)
    src[:] = os.urandom(1 << 20)
    assert ps.write([WriteItem("a" * 64, spec, [memoryview(src)])]) == [True]
    assert ps.read([ReadItem("a" * 64, spec, [memoryview(dst)])]) == [True]
    assert dst[:] == src[:]
    c = ps.counters.snapshot()
    assert c["write_direct"] == 1 and c["read_direct"] == 1
    assert "read_bounce" not in c and "write_bounce" not in c  # aligned memory: in place
    # Unaligned host memory (torch.empty blocks sit 64 bytes off a page) still
    # takes O_DIRECT, through an aligned per-thread block; 3 blocks + a tail run.
    n = (9 << 20) + 4096
    spec2 = ps.pool_spec(PoolLayout("kv", "raw", 1, (("uint8", (n,)),), n))
    src2, dst2 = bytearray(os.urandom(n + 64)), bytearray(n + 64)
    runs_src = [memoryview(src2)[64 : 64 + n // 2], memoryview(src2)[64 + n // 2 : 64 + n]]
    runs_dst = [memoryview(dst2)[64 : 64 + 1000], memoryview(dst2)[64 + 1000 : 64 + n]]
    assert ps.write([WriteItem("b" * 64, spec2, runs_src)]) == [True]
    assert ps.read([ReadItem("b" * 64, spec2, runs_dst)]) == [True]
    assert dst2[64 : 64 + n] == src2[64 : 64 + n]
    c = ps.counters.snapshot()
    assert c["write_direct"] == 2 and c["read_direct"] == 2
    assert c["write_bounce"] == 1 and c["read_bounce"] == 1  # only the unaligned page bounced
    ps.close()
