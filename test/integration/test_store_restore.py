"""The L3 store under the real stack (UnifiedRadixCache + HybridCacheController,
buffer_only, Mamba hybrid, `file` backend = patch store-file) on CPU: a bad
page on disk makes the scheduler-level restore fall back to recompute - no
exception, no wrong KV, pools back to baseline - and the page is quarantined,
rewritten by the next write-through and restored bit-exact afterwards.
Negative control: upstream HiCacheFile serves a flipped byte as valid KV."""

from __future__ import annotations

import os

import pytest
from sglang_l3.patches import framework
from sglang_l3.testing.stack import HybridSpec, L3Stack

PS = 4


def _seq(start: int = 1, pages: int = 4) -> list[int]:
    return list(range(start, start + pages * PS))


def _keys(seq):
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(seq, None, page_size=PS)


def _page(root, key: str, pool: str) -> str:
    names = [n for n in os.listdir(os.path.join(root, "pages")) if n.startswith(key + f".{pool}-")]
    assert len(names) == 1, (key, pool, names)
    return os.path.join(root, "pages", names[0])


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


def _backend(st: L3Stack):
    from sglang_l3.storage.backend import L3FileStore

    be = st.cache.cache_controller.storage_backend
    assert isinstance(be, L3FileStore), f"patch store-file not active: {type(be).__name__}"
    return be


def _damage_and_heal(tmp_path, damage, reason: str, pool: str, which: int = -1):
    seq = _seq()
    with L3Stack(HybridSpec(page_size=PS), str(tmp_path)) as st:
        be = _backend(st)
        want = st.write(seq, marker=3.0)
        key = _keys(seq)[which]
        path = _page(tmp_path, key, pool)
        damage(path)
        st.evict_all()
        st.scribble()
        st.assert_recompute(seq, "bad")
        c = be.counters()
        assert c.get(f"quarantined_{reason}") == 1, c
        assert not os.path.exists(path)
        assert any(key in q and f"-{reason}-" in q for q in os.listdir(tmp_path / "quarantine"))
        # The slot is free again: the next write-through lands and restores exactly.
        want = st.write(seq, marker=3.0)
        st.evict_all()
        st.scribble()
        req, loaded = st.restore(seq, "healed")
        assert loaded == len(seq)
        m = st.match(seq)
        assert st.snapshot(m.last_device_node, int(req.kv.mamba_pool_idx)).equal(want)
        st.release(req)
        st.evict_all()
        assert st.pool_sizes() == st.baseline


def test_zero_copy_page_functions_selected(tmp_path):
    from sglang.srt.managers.cache_controller import HiCacheController

    with L3Stack(HybridSpec(page_size=PS), str(tmp_path)) as st:
        be = _backend(st)
        cc = st.cache.cache_controller
        assert cc.page_get_func.__func__ is HiCacheController._page_get_zero_copy
        assert cc.page_set_func.__func__ is HiCacheController._page_set_zero_copy
        assert be._maps["kv"].zero_copy and be._maps["mamba"].zero_copy
        assert framework.get_status("store-file").fired.get("zero_copy_selected", 0) >= 1


def test_corrupt_mamba_state_falls_back_to_recompute(tmp_path):
    _damage_and_heal(tmp_path, _flip_last_byte, "checksum", "mamba")


@pytest.mark.all_seeds()
def test_corrupt_kv_page_mid_chain_falls_back_to_recompute(tmp_path):
    _damage_and_heal(tmp_path, _flip_last_byte, "checksum", "kv", which=1)


def test_truncated_mamba_state_is_not_promised(tmp_path):
    _damage_and_heal(tmp_path, lambda p: os.truncate(p, 100), "size", "mamba")


def test_foreign_page_falls_back_to_recompute(tmp_path):
    """Another context's valid page swapped in under this key."""
    other = _seq(start=500)
    seq = _seq()
    with L3Stack(HybridSpec(page_size=PS), str(tmp_path)) as st:
        be = _backend(st)
        st.write(seq, marker=3.0)
        st.write(other, marker=4.0)
        victim = _page(tmp_path, _keys(seq)[-1], "kv")
        os.replace(_page(tmp_path, _keys(other)[-1], "kv"), victim)
        st.evict_all()
        st.scribble()
        st.assert_recompute(seq, "foreign")
        assert be.counters().get("quarantined_identity") == 1


@pytest.mark.all_seeds()
def test_damaged_page_from_a_previous_run_after_restart(tmp_path):
    seq = _seq()
    with L3Stack(HybridSpec(page_size=PS), str(tmp_path)) as producer:
        producer.write(seq, marker=5.0)
    _flip_last_byte(_page(tmp_path, _keys(seq)[0], "kv"))
    with L3Stack(HybridSpec(page_size=PS), str(tmp_path)) as st:
        st.scribble()
        st.assert_recompute(seq, "restart")
        assert _backend(st).counters().get("quarantined_checksum") == 1


@pytest.fixture
def upstream_file_backend():
    framework.undo("store-file")
    try:
        yield
    finally:
        spec = next(s for s in framework.load_series() if s.id == "store-file")
        framework.apply_one(spec)


def test_negative_control_upstream_serves_a_flipped_byte(tmp_path, upstream_file_backend):
    """Without the patch: the same damage restores silently wrong KV."""
    seq = _seq()
    with L3Stack(HybridSpec(page_size=PS), str(tmp_path)) as st:
        assert type(st.cache.cache_controller.storage_backend).__name__ == "HiCacheFile"
        want = st.write(seq, marker=3.0)
        key = _keys(seq)[1]
        raw = [n for n in os.listdir(tmp_path) if n.startswith(key) and ".mamba" not in n]
        assert len(raw) == 1
        with open(tmp_path / raw[0], "r+b") as f:  # flip a bit of layer 0's K (what snapshot compares)
            f.seek(11)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
        st.evict_all()
        st.scribble()
        st.check_forward_kv = False  # the wrong KV is what this control shows
        req, loaded = st.restore(seq, "upstream")
        assert loaded == len(seq), "upstream restores the damaged page as valid"
        m = st.match(seq)
        assert not st.snapshot(m.last_device_node, int(req.kv.mamba_pool_idx)).equal(want), (
            "expected upstream to serve the corrupted KV"
        )
        st.release(req)
