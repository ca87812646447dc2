"""The L3 write path of a Mamba hybrid: what a later, fresh process can restore.

- branch points: a state donated to a node that already exists reaches L3
  (`branch-backup`, #37613 residual); negative control with the patch undone;
- partial damage: a truncated Mamba page costs only the pages after the last
  intact state, and is rewritten by the next write of that prefix (store);
- identity: a bf16-written store read by an fp16 reader is a miss (store).

A new `L3Stack` over the same directory stands for a restarted process.
"""

from __future__ import annotations

import os

import pytest
import torch
from sglang_l3 import metrics
from sglang_l3.metrics import store_counters
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack

# Under every simulated-device seed (test/integration/conftest.py); the second seed
# only on the Rust tree core (suite time).
pytestmark = pytest.mark.all_seeds(core=("rust",))


def _serve(h: SchedulerHarness, seq: list[int]) -> None:
    """One request through admission → forward (all chunks) → finish, then drain L3 writes."""
    h.serve(h.make_req(seq))
    h.stack.flush_backups()


def _branch_point_run(tmp_path, core: str) -> tuple[int, bool]:
    """A and B diverge at token 256; a third request ending exactly there
    donates its state to the (existing) branch node. A fresh process serves C,
    which shares only those 256 tokens. Returns (restored, state bit-exact)."""
    spec = HybridSpec(page_size=1, kv_size=2048)
    T = list(range(1, 257))
    A, B, C = T + list(range(1000, 1020)), T + list(range(2000, 2020)), T + list(range(3000, 3010))
    with L3Stack(spec, str(tmp_path), tree_core=core) as st:
        h = SchedulerHarness(st)
        _serve(h, A)
        _serve(h, B)
        assert st.match(T).device_prefix_len == 0, "no state at the branch point yet"
        _serve(h, T)
        m = st.match(T)
        assert m.device_prefix_len == 256, "the request must donate its state to the branch node"
        want = st.snapshot(m.last_device_node, st.node_mamba_slot(m.last_device_node))
    with L3Stack(spec, str(tmp_path), tree_core=core) as fresh:
        _, loaded = fresh.prefetch(C, "c-probe")
        if loaded == 0:
            return 0, False
        fresh.evict_all()
        req, n = fresh.restore(C, "c")
        node = fresh.match(T).last_device_node
        exact = fresh.snapshot(node, fresh.node_mamba_slot(node)).equal(want)
        exact = exact and fresh.snapshot(node, int(req.kv.mamba_pool_idx)).equal(want)
        fresh.release(req)
        return n, exact


def test_branch_point_state_reaches_l3(tmp_path, core: str) -> None:
    before = metrics.get("branch_backups", "queued")
    restored, exact = _branch_point_run(tmp_path, core)
    assert restored == 256
    assert exact, "restored KV / Mamba state differ from what was written"
    assert metrics.get("branch_backups", "queued") > before


@pytest.mark.parametrize("without", ["branch-backup"], indirect=True)
def test_branch_point_lost_without_patch(tmp_path, core: str, without) -> None:
    restored, _ = _branch_point_run(tmp_path, core)
    assert restored == 0  # upstream 0.5.23: KV for [0,256) is in L3, its state is not


def test_walk_set_never_outlives_its_insert(tmp_path, core: str) -> None:
    """The walk set captured at end_insert_walk is consumed by the same insert on
    every path, including the early returns (state already there, no state given),
    so no later insert can read a stale one."""
    from sglang_l3.patches.hicache.branch_backup import LAST_WALK_ATTR

    spec = HybridSpec(page_size=4, kv_size=2048)
    with L3Stack(spec, str(tmp_path), tree_core=core) as st:
        pipe = st.cache.buffer_pipeline
        for i, seq in enumerate((A24, A24, B24, T16)):  # i=1: mamba_exist -> early return
            st.write(seq)
            assert vars(pipe).get(LAST_WALK_ATTR) is None, f"walk set left behind by insert {i} ({len(seq)} tokens)"


# --- the same holes at the cache level, page size 4 ------------------------ #
T16 = list(range(1, 17))
A24, B24, C20 = T16 + list(range(100, 108)), T16 + list(range(200, 208)), T16 + [300, 301, 302, 303]


def _write_then_probe(tmp_path, core: str, seqs: list[list[int]]) -> int:
    spec = HybridSpec(page_size=4, kv_size=2048)
    with L3Stack(spec, str(tmp_path), tree_core=core) as st:
        for s in seqs:
            st.write(s)
    with L3Stack(spec, str(tmp_path), tree_core=core) as fresh:
        return fresh.prefetch(C20, "probe")[1]


@pytest.mark.parametrize("case", ["branch", "split_parent"])
def test_state_on_existing_node(tmp_path, core: str, case: str) -> None:
    seqs = [A24, B24, T16] if case == "branch" else [A24, T16]
    assert _write_then_probe(tmp_path, core, seqs) == 16


@pytest.mark.parametrize("case", ["branch", "split_parent"])
@pytest.mark.parametrize("without", ["branch-backup"], indirect=True)
def test_state_on_existing_node_without_patch(tmp_path, case: str, without) -> None:
    seqs = [A24, B24, T16] if case == "branch" else [A24, T16]
    assert _write_then_probe(tmp_path, "rust", seqs) == 0


# --- partial damage ------------------------------------------------------- #
def _mamba_path(st: L3Stack, seq: list[int]) -> str:
    node = st.match(seq).last_device_node
    snap = st.cache.tree_core.snapshot_buffer_backup(node, False)
    backend = st.cache.cache_controller.storage_backend
    return backend.store.path_of(snap.hash_values[-1], backend._specs["mamba"])


def test_truncated_state_costs_only_its_pages(tmp_path, core: str) -> None:
    """8 pages, states every 2 pages; the state at page 8 is truncated →
    6 pages restored, and the next write of the prefix rewrites it."""
    spec = HybridSpec(page_size=4, kv_size=2048)
    seq = list(range(1, 33))
    with L3Stack(spec, str(tmp_path), tree_core=core) as st:
        for pages in (2, 4, 6, 8):
            st.write(seq[: pages * 4])
        path = _mamba_path(st, seq)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    c0 = store_counters()
    with L3Stack(spec, str(tmp_path), tree_core=core) as fresh:
        _, loaded = fresh.prefetch(seq + [900, 901, 902, 903], "partial")
        assert loaded == 24
        c1 = store_counters()
        assert c1.get("quarantined_size", 0) == c0.get("quarantined_size", 0) + 1
        assert not os.path.exists(path)
        fresh.write(seq)  # the prefix recomputed and written again
        assert os.path.getsize(path) == size
        assert store_counters().get("write_ok", 0) > c1.get("write_ok", 0)
    with L3Stack(spec, str(tmp_path), tree_core=core) as again:
        assert again.prefetch(seq + [900, 901, 902, 903], "full")[1] == 32


# --- identity ------------------------------------------------------------- #
def test_bf16_store_is_a_miss_for_fp16_reader(tmp_path) -> None:
    seq = list(range(1, 33))
    with L3Stack(HybridSpec(page_size=4, kv_size=2048, dtype=torch.bfloat16), str(tmp_path)) as st:
        st.write(seq)
    with L3Stack(HybridSpec(page_size=4, kv_size=2048, dtype=torch.float16), str(tmp_path)) as reader:
        assert reader.prefetch(seq + [900], "fp16")[1] == 0
    with L3Stack(HybridSpec(page_size=4, kv_size=2048, dtype=torch.bfloat16), str(tmp_path)) as same:
        assert same.prefetch(seq + [900], "bf16")[1] == 32  # the control: same identity hits
