"""A turn inserted inside another context's node whose L3 write was launched but not
yet acknowledged reaches L3 (`split-parent-cover`, issue 49 item 6, the known miss).

Two agents with one system prompt: B's first call is computed from A's checkpoint and
inserted over A's node while A's write is past its D2H launch. The insert splits A's
node; the launched write carries the split parent's pages under A's node id, so the
walk queues nothing for the split parent, and B's own write failed upstream's
parent-cover gate (`l3_write_dropped{parent_not_stored}`): B's first turn never
reached L3.

Real upstream stack on CPU (`L3Stack`), both tree cores, page sizes 1 and 64: A is
written and launched, B (A's first 896 tokens + its own 384) inserted before the
storage ack; after the writes settle a fresh reader restores B whole, KV and both
Mamba slots bit-exact, pools back at baseline. Negative control: the same run
without the patch drops B's write, and the reader restores nothing of B (the shared
part has no Mamba state of its own: B's context is recomputed).
"""

from __future__ import annotations

import pytest
from sglang_l3 import metrics
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack, RestoreFailed

KV_SIZE = 4096
SHARED, A_LEN, B_OWN = 896, 1280, 384


def _spec(page: int) -> HybridSpec:
    return HybridSpec(page_size=page, kv_size=KV_SIZE, max_context_len=2048)


def _write_a_then_b(tmp_path, page: int, core: str) -> tuple[list[int], object, float, float]:
    """A written and launched; B inserted before A's storage ack; drained.
    Returns (B, B's snapshot, parent_not_stored drops, parents found in flight)."""
    a = list(range(9, 9 + A_LEN))
    b = a[:SHARED] + list(range(50_000, 50_000 + B_OWN))
    with L3Stack(_spec(page), str(tmp_path), tree_core=core, server_args={"hicache_ratio": 1.0}) as w:
        pipe = w.cache.buffer_pipeline
        dropped = metrics.get("l3_write_dropped", "parent_not_stored")
        in_flight = metrics.get("l3_write_parent_in_flight")
        w.write(a, marker=3.0, flush=False)
        pipe.flush_pending_writes()  # A's D2H launched, its storage write not yet acknowledged
        assert not pipe.pending_write_queue and pipe.ongoing_write_through, "A's write is launched"
        want = w.write(b, marker=4.0, flush=False)
        w.settle(timeout=120)
        assert not pipe.inflight_backup_pools and not pipe.pending_write_queue
        w.evict_all()
        w.settle()
        assert w.pool_sizes() == w.baseline
        return (
            b,
            want,
            metrics.get("l3_write_dropped", "parent_not_stored") - dropped,
            metrics.get("l3_write_parent_in_flight") - in_flight,
        )


def _restore(tmp_path, page: int, core: str, seq: list[int], want) -> int:
    with L3Stack(_spec(page), str(tmp_path), tree_core=core, server_args={"hicache_ratio": 1.0}) as r:
        r.scribble()
        try:
            req, loaded = r.restore(seq, "reader")
        except RestoreFailed:
            return 0  # nothing restorable: the shared part has no Mamba state of its own
        if loaded == len(seq) // page * page:
            r.check_restored(seq, req, loaded, want, kv=True)
        r.release(req)
        r.evict_all()
        r.settle()
        assert r.pool_sizes() == r.baseline
        return loaded


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("core", TREE_CORES)
def test_a_turn_inserted_over_a_launched_write_reaches_l3(tmp_path, page: int, core: str) -> None:
    b, want, drops, in_flight = _write_a_then_b(tmp_path, page, core)
    assert drops == 0, f"{drops} parent_not_stored drops"
    assert in_flight >= 1, "B's parent was found in flight"
    assert _restore(tmp_path, page, core, b, want) == len(b)


@pytest.mark.parametrize("without", ["split-parent-cover"], indirect=True)
def test_without_the_patch_the_turn_is_dropped(tmp_path, without) -> None:
    b, want, drops, in_flight = _write_a_then_b(tmp_path, 64, "rust")
    assert drops >= 1 and in_flight == 0
    assert _restore(tmp_path, 64, "rust", b, want) == 0
