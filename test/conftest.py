"""Test session set-up: CPU shims (no GPU here), then the whole sglang-l3 patch
queue applied in-process, as the plugin does in every SGLang process."""

from __future__ import annotations

import os
import sys

import pytest

# This process keeps its counters in memory (servers it starts publish theirs).
os.environ.setdefault("SGLANG_L3_PUBLISH_STATS", "0")
# One JIT build of HiCache's hash extension per venv, inherited by test servers
# (a build dir shared between venvs is rebuilt on every switch).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
sys.path.insert(0, os.path.dirname(__file__))


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in (
        ("gpu", "needs a CUDA/ROCm GPU; skipped without one"),
        ("rdna3", "needs an RDNA3 (gfx11xx) GPU; skipped elsewhere"),
        ("e2e", "starts a real SGLang server"),
        ("slow", "takes more than a few seconds"),
        ("aot", "ahead-of-time compiles Triton kernels for gfx1100 (no GPU needed)"),
        ("l3_wait_abandoned_expected", "the test makes the L3 wait watchdog abandon a request on purpose"),
    ):
        config.addinivalue_line("markers", f"{name}: {doc}")
    if not _gpu_present():
        import sglang_l3.cpu

        sglang_l3.cpu.enable()
    # Upstream compiles its page-hash extension lazily inside the prefetch
    # thread; on a fresh, busy machine that outlasts the waits. Build it now.
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    _load_native_hash_module()
    import sglang_l3.plugin

    sglang_l3.plugin.register()


@pytest.fixture(autouse=True)
def _no_l3_wait_abandoned(request: pytest.FixtureRequest):
    """The L3 wait watchdog's counter must stay 0: a request abandoned by it waited
    on L3 past its budget (a hang, ended). Servers' counters: tp2_e2e.generate."""
    from sglang_l3 import metrics

    before = metrics.get("l3_wait_abandoned")
    yield
    after = metrics.get("l3_wait_abandoned")
    if after != before and request.node.get_closest_marker("l3_wait_abandoned_expected") is None:
        pytest.fail(f"l3_wait_abandoned rose by {after - before}: a request waited on L3 past its budget")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_present():
        return
    skip = pytest.mark.skip(reason="needs a GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords or "rdna3" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter) -> None:
    """For the upstream kits: how many cases were composed, passed, skipped."""
    stats = terminalreporter.stats

    def count(key: str) -> int:
        return sum(1 for r in stats.get(key, []) if "upstream/test_kits.py" in str(getattr(r, "nodeid", "")))

    composed = sum(count(k) for k in ("passed", "failed", "skipped", "error"))
    if composed:
        terminalreporter.write_line(
            f"[upstream kits] composed={composed} passed={count('passed')} "
            f"skipped={count('skipped')} failed={count('failed') + count('error')}"
        )
