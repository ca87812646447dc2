"""A lookup of pages whose L3 write is queued waits for it (patch `lookup-waits-write`).

Real upstream stack on CPU (`L3Stack`), both tree cores, page 64. A 1,024-token context
is written through; its store write is held at the disk (a test fault: `PageStore.write`
waits on a gate) after the pages were staged on the host, so the device node may go, and
goes (`evict_all`), as another agent's admission would take it. A request for the same
context looks it up while the write is still held; the gate opens half a second later.
With the patch the lookup waits and the whole context is restored bit-exact (KV and the
Mamba state); pools back to baseline. Negative control: without the patch the lookup
misses (0 tokens).
"""

from __future__ import annotations

import threading

import pytest
from sglang_l3 import metrics
from sglang_l3.storage import pending_writes
from sglang_l3.storage.store import PageStore
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack

SPEC = HybridSpec(page_size=64, kv_size=4096, max_context_len=4096)
SEQ = list(range(7, 7 + 1024))
HELD_S = 0.5


@pytest.fixture
def held_writes(monkeypatch):
    """Store writes wait until the returned gate is set (set at teardown at the latest)."""
    gate = threading.Event()
    orig = PageStore.write

    def write(self, items):
        assert gate.wait(120), "the test never opened the write gate"
        return orig(self, items)

    monkeypatch.setattr(PageStore, "write", write)
    yield gate
    gate.set()


def _lookup_while_held(tmp_path, core: str, gate: threading.Event) -> tuple[int, int]:
    """(tokens restored, lookups that waited for a write)."""
    with L3Stack(SPEC, str(tmp_path), tree_core=core, server_args={"hicache_ratio": 1.0}) as st:
        want = st.write(SEQ, marker=2.0, flush=False)
        bp = st.cache.buffer_pipeline
        st.evict_all()  # stages the queued write first (write-guard), then the node may go
        assert st.match(SEQ).device_prefix_len == 0, "the node stayed on the device"
        assert bp.ongoing_backup, "the store write is not held"
        waited = metrics.get("store_exists_waited_write")
        opener = threading.Timer(HELD_S, gate.set)
        opener.start()
        h, loaded = st.prefetch(SEQ, "reader")
        opener.join()
        waited = metrics.get("store_exists_waited_write") - waited
        if loaded:
            st.cache.buffer_pipeline.release_staged_hold(h)
            st.settle()
            req, loaded = st.restore(SEQ, "reader-2")
            st.check_restored(SEQ, req, loaded, want, kv=True)
            st.release(req)
        elif bp.has_staged(h):
            bp.release_staged_hold(h)
        st.flush_backups()
        st.evict_all()
        st.settle()
        assert st.pool_sizes() == st.baseline, "a pool is not back at its baseline"
        assert not st.cache.cache_controller.storage_backend.pending_writes
        return loaded, int(waited)


@pytest.mark.parametrize("core", TREE_CORES)
def test_a_lookup_waits_for_the_queued_write_of_its_pages(tmp_path, core: str, held_writes) -> None:
    loaded, waited = _lookup_while_held(tmp_path, core, held_writes)
    assert loaded == len(SEQ)
    assert waited >= 1


@pytest.mark.parametrize("without", ["lookup-waits-write"], indirect=True)
def test_without_the_patch_the_lookup_misses(tmp_path, without, held_writes) -> None:
    loaded, waited = _lookup_while_held(tmp_path, "rust", held_writes)
    assert loaded == 0
    assert waited == 0


def test_pending_writes_wait() -> None:
    p = pending_writes.PendingWrites()
    page = ("kv", "a")
    assert p.wait([page], 0.01) is None  # nothing queued: no wait
    p.add([page, page])
    p.remove([page])
    assert p.wait([page], 0.01) is False  # one of two writes still queued
    threading.Timer(0.05, p.remove, args=([page],)).start()
    assert p.wait([page, ("kv", "b")], 30) is True
    assert len(p) == 0
    p.remove([page])  # more releases than notes never go negative
    p.add([page])
    assert len(p) == 1
    p.clear()
    assert p.wait([page], 0.01) is None
