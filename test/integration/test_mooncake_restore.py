"""The hybrid L3 lifecycle on Mooncake, on the real upstream stack on CPU.

UnifiedRadixCache + HybridCacheController + buffer_only + upstream's `mooncake`
backend (`--hicache-storage-backend mooncake`), every sglang-l3 patch applied,
against a real `mooncake_master` + storage node on 127.0.0.1 (one per module):
write -> evict -> prefetch -> re-anchor -> KV and both Mamba slots bit-exact,
page sizes 1 and 64, in the same cache and in a second instance (another
"node"); a missing object and a master restart are misses that end in
recompute, never wrong data; a foreign identity (other KV dtype) gets misses.
Skipped with the reason when Mooncake is not installed, unless
SGLANG_L3_REQUIRE_MOONCAKE=1 (set by `make test`), which turns that into a failure.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch
from mooncake_support import require_mooncake
from sglang_l3.patches import framework
from sglang_l3.testing import mooncake as mc
from sglang_l3.testing.stack import HybridSpec, L3Stack, RestoreFailed

# Cheap: every test runs under every simulated-device seed (test/integration/conftest.py).
pytestmark = pytest.mark.all_seeds()

PAGE_SIZES = (1, 64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[mc.MooncakeCluster]:
    require_mooncake()
    c = mc.MooncakeCluster(tmp_path_factory.mktemp("mooncake"))
    try:
        c.start()
        yield c
    finally:
        c.stop()  # by PID (process groups)


@pytest.fixture
def store(cluster) -> Iterator[object]:
    """A segment-less client on the same master; empties the store per test."""
    s = mc.client(cluster)
    s.remove_all(True)  # force: objects read in the last seconds hold a lease
    yield s
    s.remove_all(True)


@contextlib.contextmanager
def _stack(cluster, tmp_path, page_size: int, **kw) -> Iterator[L3Stack]:
    import psutil
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    # The host pools here are a few MB; upstream's 10 GiB free-RAM reserve
    # (pool_host/base.py) is more than a busy shared test machine has.
    with host_memory_budget_scope(psutil.virtual_memory().available // 2):
        st = L3Stack(
            HybridSpec(page_size=page_size, **kw.pop("spec", {})),
            str(tmp_path),
            storage_backend="mooncake",
            extra_config=cluster.extra_config(),
            **kw,
        )
    with st:
        yield st


def _seq(page_size: int, pages: int = 4, start: int = 1) -> list[int]:
    return list(range(start, start + max(pages * page_size, 16)))


def _object_keys(st: L3Stack, seq, page_size: int) -> list[str]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    be = st.cache.cache_controller.storage_backend
    return [f"{be.config_prefix}_{h}" for h in get_storage_hash_str(seq, None, page_size=page_size)]


def test_all_patches_applied_and_backend_is_mooncake(cluster, store, tmp_path) -> None:
    failed = {
        pid: s.state
        for pid, s in framework.status().items()
        if s.state not in (framework.State.APPLIED, framework.State.NOT_APPLICABLE)
    }
    assert not failed, failed
    assert framework.is_applied("mooncake-identity")
    with _stack(cluster, tmp_path, 1) as st:
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
            MooncakeStore,
        )

        assert isinstance(st.cache.cache_controller.storage_backend, MooncakeStore)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_lifecycle_bit_exact(cluster, store, tmp_path, page_size: int) -> None:
    seq = _seq(page_size)
    with _stack(cluster, tmp_path, page_size) as st:
        want = st.write(seq, marker=3.0)
        keys = _object_keys(st, seq, page_size)
        assert all(store.is_exist(f"{k}_0_k") == 1 for k in keys), "KV pages not in Mooncake"
        assert store.is_exist(f"{keys[-1]}_0_temporal") == 1, "Mamba state not in Mooncake"
        st.evict_all()
        m = st.match(seq)
        assert (m.device_prefix_len, m.host_hit_length) == (0, 0)
        st.scribble()
        req, loaded = st.restore(seq, "same")
        st.check_restored(seq, req, loaded, want)
        st.cache.sanity_check()
        st.release(req)
        st.evict_all()
        assert st.pool_sizes() == st.baseline, "a pool did not return to its baseline"
    # a second instance on the same master (another process/node): restores too
    with _stack(cluster, tmp_path, page_size) as st:
        st.scribble()
        req, loaded = st.restore(seq, "other")
        st.check_restored(seq, req, loaded, want)
        st.release(req)
        st.evict_all()
        assert st.pool_sizes() == st.baseline


@pytest.mark.parametrize("what", ["mamba_state", "kv_page_mid_chain"])
def test_missing_object_is_a_miss_then_heals(cluster, store, tmp_path, what: str) -> None:
    ps = 1
    seq = _seq(ps, pages=32, start=5000)  # shares no prefix with other tests' pages
    with _stack(cluster, tmp_path, ps) as st:
        want = st.write(seq, marker=4.0)
        keys = _object_keys(st, seq, ps)
        victim = f"{keys[-1]}_0_temporal" if what == "mamba_state" else f"{keys[len(keys) // 2]}_0_k"
        assert store.remove(victim, True) == 0, f"could not remove {victim}"  # force: past its read lease
        st.evict_all()
        st.scribble()
        st.assert_recompute(seq, "damaged")
        # the next write-through puts the missing object back; then it restores exactly
        want = st.write(seq, marker=4.0)
        assert store.is_exist(victim) == 1, "write-through did not heal the missing object"
        st.evict_all()
        st.scribble()
        req, loaded = st.restore(seq, "healed")
        st.check_restored(seq, req, loaded, want)
        st.release(req)


def test_master_restart_is_a_miss_never_wrong(cluster, store, tmp_path) -> None:
    ps = 64
    seq = _seq(ps, start=9000)
    with _stack(cluster, tmp_path, ps) as st:
        st.write(seq, marker=6.0)
        st.evict_all()
        cluster.restart_master()  # every object's metadata is gone
        st.scribble()
        st.assert_recompute(seq, "after-restart")
        # the store comes back: once the storage node has remounted, writes restore again
        deadline = time.monotonic() + 60
        while not cluster.segments() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cluster.segments(), "storage node did not remount its segment"
        want = st.write(seq, marker=7.0)
        st.evict_all()
        st.scribble()
        req, loaded = st.restore(seq, "rewritten")
        st.check_restored(seq, req, loaded, want)
        st.release(req)


def _foreign_read(cluster, tmp_path, seq, ps) -> tuple[int, bool]:
    """bf16 instance writes; an fp16 instance (same page bytes) prefetches.
    Returns (tokens the fp16 instance loaded, whether its KV equals what it expects)."""
    with _stack(cluster, tmp_path, ps, spec={"dtype": torch.bfloat16}) as st:
        st.write(seq, marker=2.0)
    with _stack(cluster, tmp_path, ps, spec={"dtype": torch.float16}) as st:
        st.check_forward_kv = False  # compared below: foreign bytes are what this test looks for
        st.scribble()
        try:
            _req, loaded = st.restore(seq, "foreign")
        except RestoreFailed:
            return 0, True
        m = st.match(seq)
        k, v = st.expected_kv(seq)
        got = st.snapshot(m.last_device_node, None)
        return loaded, torch.equal(got.k, k) and torch.equal(got.v, v)


def test_foreign_identity_misses(cluster, store, tmp_path) -> None:
    loaded, _ = _foreign_read(cluster, tmp_path, _seq(1), 1)
    assert loaded == 0, "an fp16 instance restored pages a bf16 instance wrote"


@pytest.mark.parametrize("without", ["mooncake-identity"], indirect=True)
def test_negative_control_upstream_keys_serve_foreign_pages(cluster, store, tmp_path, without) -> None:
    """Without the patch an fp16 instance restores bf16 pages as its own: wrong KV."""
    loaded, exact = _foreign_read(cluster, tmp_path, _seq(1), 1)
    assert loaded > 0 and not exact


def test_store_listens_on_loopback_only(cluster, tmp_path) -> None:
    """The master (RPC + metrics) and the storage node's service port are on
    127.0.0.1; the only other listeners are the transfer engine's, which
    Mooncake 0.3.13 binds to all interfaces with no option to narrow it
    (see sglang_l3.testing.mooncake)."""
    master = cluster.master_listeners()
    assert {lst.port for lst in master} == {cluster.rpc_port, cluster.metrics_port}, master
    assert all(lst.loopback for lst in master), master
    everything = mc.listeners(cluster.pids())
    exposed = [lst for lst in everything if not lst.loopback]
    assert all(mc.transfer_engine_listener(lst) for lst in exposed), exposed
    node = [lst for lst in everything if lst.port == cluster.node_port]
    assert node and all(lst.loopback for lst in node), everything
