"""Mamba hybrid, buffer_only, `file` backend, real upstream stack on CPU:
insert KV + Mamba → written to L3 → evicted → device pools overwritten →
prefetch → stage → init_load_back → ack → KV, the request's and the node's
Mamba state bit-exact; same cache and a fresh instance over the same directory
(a restart); page sizes 1, 4, 64, 128; Rust and Python tree cores."""

from __future__ import annotations

import os
import time

import pytest
from sglang_l3.testing import speed
from sglang_l3.testing.stack import HybridSpec, L3Stack

# Under every simulated-device seed (test/integration/conftest.py); the second seed
# only at page sizes 4 and 64 (suite time).
pytestmark = pytest.mark.all_seeds(page_size=(4, 64))

PAGE_SIZES = (1, 4, 64, 128)
TREE_CORES = ("rust", "python")


def _seq(page_size: int, pages: int = 4, start: int = 1) -> list[int]:
    n = max(pages * page_size, 16)
    return list(range(start, start + n))


@pytest.mark.parametrize("tree_core", TREE_CORES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_evict_then_restore_same_cache(tmp_path, page_size: int, tree_core: str) -> None:
    with L3Stack(HybridSpec(page_size=page_size), str(tmp_path), tree_core=tree_core) as st:
        seq = _seq(page_size)
        want = st.write(seq, marker=3.0)
        assert os.listdir(tmp_path), "nothing reached L3"
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


@pytest.mark.parametrize("tree_core", TREE_CORES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_restore_after_restart(tmp_path, page_size: int, tree_core: str) -> None:
    seq = _seq(page_size)
    with L3Stack(HybridSpec(page_size=page_size), str(tmp_path), tree_core=tree_core) as producer:
        want = producer.write(seq, marker=5.0)
    with L3Stack(HybridSpec(page_size=page_size), str(tmp_path), tree_core=tree_core) as st:
        st.scribble()
        req, loaded = st.restore(seq, "fresh")
        st.check_restored(seq, req, loaded, want)
        st.release(req)
        st.evict_all()
        assert st.pool_sizes() == st.baseline


def test_unrelated_prefix_misses(tmp_path) -> None:
    with L3Stack(HybridSpec(page_size=4), str(tmp_path)) as st:
        st.write(_seq(4), marker=2.0)
        h, loaded = st.prefetch(_seq(4, start=1000), "miss")
        assert loaded == 0
        assert not st.cache.buffer_pipeline.has_staged(h)


def test_closed_stack_leaves_no_store_threads(tmp_path) -> None:
    """L3Stack.close closes the store: its session-table writer thread stops."""
    import threading

    # by identity, not by count: an earlier test's writer may still be ending (busy machine)
    before = {t for t in threading.enumerate() if t.name == "sglang-l3-sessions"}

    def new_writers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "sglang-l3-sessions" and t.is_alive() and t not in before]

    for _ in range(3):
        with L3Stack(HybridSpec(page_size=4), str(tmp_path)) as st:
            st.write(_seq(4), marker=1.0)
    deadline = time.monotonic() + speed.scaled(30)
    while new_writers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not new_writers(), f"{len(new_writers())} session writer thread(s) left behind"


@pytest.mark.parametrize("fenced", (True, False))
def test_a_forward_in_flight_lands_before_the_load_back(tmp_path, fenced: bool) -> None:
    """The harness's forward-stream checks on upstream's own load-back (simulated device,
    or a GPU whose forward stream is kept busy): a forward still writing rows that were
    freed (overlap scheduling) is ordered before the load-back by upstream's fence
    (`load_fence_stream`, wired as the scheduler wires it); without the fence (control)
    the forward-time read of the restored rows catches the corruption before the ack."""
    from sglang_l3.sim import streams as sim_streams
    from sglang_l3.testing.device import on_gpu
    from sglang_l3.testing.stack import RestoreFailed

    assert on_gpu() or sim_streams.installed()
    with L3Stack(HybridSpec(page_size=4), str(tmp_path)) as st:
        seq = _seq(4, pages=16)
        want = st.write(seq, marker=3.0)
        st.evict_all()
        st.scribble()
        if not fenced:
            st.cache.cache_controller.load_fence_stream = None
        freed = st.inflight_forward_write_then_free()
        assert st.forward_busy()
        h, loaded = st.prefetch(seq, "inflight")
        assert loaded == len(seq)
        # The copy engine runs the load-back before the forward stream gets there.
        if not fenced:
            with pytest.raises(RestoreFailed, match="forward pass read wrong KV"):
                st.admit(h, seq, "inflight", loads_first=True)
            return
        req, n = st.admit(h, seq, "inflight", loads_first=True)
        rows = set(st.cache.path_device_indices(st.match(seq).last_device_node).tolist())
        assert rows <= set(freed.tolist()), "the restore must land in rows the forward still wrote"
        st.check_restored(seq, req, n, want, kv=True)
        st.release(req)
        st.evict_all()
        assert st.pool_sizes() == st.baseline
