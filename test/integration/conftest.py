"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest
from sglang_l3.patches import framework
from sglang_l3.sim.harness import seeds, simulated_device
from sglang_l3.testing.device import SIM_ONLY_REASON, on_gpu
from sglang_l3.testing.stack import TREE_CORES


@pytest.fixture
def without(request):
    """Negative control: run the test with the patch named by the indirect
    parameter removed from this process, then apply it again."""
    pid = request.param
    series = framework.load_series()
    removed = framework.undo(pid)  # with the patches that require it
    yield pid
    for rid in [pid, *removed]:
        framework.apply_one(next(s for s in series if s.id == rid), series)


@pytest.fixture
def small_host_reserve(request):
    """Upstream keeps 10 GiB of host RAM free before it builds any host pool
    (pool_host/base.py host_memory_budget_bytes); the pools here are a few MiB,
    and the shared test machine often has less than 10 GiB available.

    The constant is a fingerprinted target (patch startup-checks): a negative
    control's `without` re-applies patches, and one applied after the undone patch
    in this process (an earlier test's undo moves it there) would see the lowered
    value as drift. So `without` is set up before the lowering and torn down after
    it is restored (a clean-clone CI run hit it once the order came out so)."""
    if "without" in request.fixturenames:
        request.getfixturevalue("without")
    from sglang.srt.mem_cache.pool_host import base

    request.getfixturevalue("monkeypatch").setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 256 * 2**20)


@pytest.fixture(params=TREE_CORES)
def core(request) -> str:
    """Each radix-tree core the cache stack can run on."""
    return request.param


# Every test of these files moves data through HiCache: it runs on the simulated
# asynchronous device (sglang_l3.sim.harness), under the first seed; the tests (or
# parameter sets) marked `all_seeds` run under every seed. Started with
# SGLANG_L3_SIM_STREAMS=N, every test of them runs under seed N only. With
# SGLANG_L3_TEST_DEVICE=cuda they run once, on the GPU's own streams (id "cuda"), and
# the tests marked `sim_only` (they drive the simulator itself) are skipped.
ON_GPU = on_gpu()
SEEDS = seeds()
SIM_FILES = {
    "test_abort_idle_check.py",
    "test_damage_fallback.py",
    "test_eager_page_hash.py",
    "test_l3_restore.py",
    "test_lookup_waits_write.py",
    "test_mooncake_restore.py",
    "test_reanchor.py",
    "test_session_guard.py",
    "test_sessions_stack.py",
    "test_stale_cow.py",
    "test_store_restore.py",
    "test_stream_fitting_hits.py",
    "test_streamed_restore.py",
    "test_streamed_restore_async.py",
    "test_streamed_restore_burst.py",
    "test_streamed_restore_evict.py",
    "test_streamed_restore_short.py",
    "test_streamed_restore_waits_write.py",
    "test_streamed_write.py",
    "test_streamed_write_parent.py",
    "test_write_path.py",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "all_seeds(**params): run under every simulated-device seed, not the first seed only; "
        "with params, only the parameter sets whose values are in the given tuples (a test "
        "without that parameter is not constrained by it)",
    )
    config.addinivalue_line(
        "markers", "sim_only: drives the simulated device itself (its queues, acks, coins); skipped on a GPU"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sim_device" in metafunc.fixturenames and metafunc.definition.path.name in SIM_FILES:
        if ON_GPU:
            metafunc.parametrize("sim_device", [None], indirect=True, ids=["cuda"])
        else:
            metafunc.parametrize("sim_device", SEEDS, indirect=True, ids=[f"sim{s}" for s in SEEDS])


def _all_seeds(item: pytest.Item) -> bool:
    mark = item.get_closest_marker("all_seeds")
    if mark is None:
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    return all(k not in params or params[k] in v for k, v in mark.kwargs.items())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    skip_sim = pytest.mark.skip(reason=SIM_ONLY_REASON)
    for item in items:
        if ON_GPU and item.get_closest_marker("sim_only"):
            item.add_marker(skip_sim)
        seed = getattr(getattr(item, "callspec", None), "params", {}).get("sim_device")
        (drop if seed not in (None, SEEDS[0]) and not _all_seeds(item) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def sim_device(request):
    """The simulated device under the parametrized seed (none for other files)."""
    seed = getattr(request, "param", None)
    if seed is None:
        yield None
        return
    with simulated_device(seed):
        yield seed
