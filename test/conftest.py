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
        (
            "agents",
            "drives real hermes-agent processes against a server (test/agents: in `make test`, alone `make test-agents`)",
        ),
        ("aot", "ahead-of-time compiles Triton kernels for gfx1100 (no GPU needed)"),
        ("l3_wait_abandoned_expected", "the test makes the L3 wait watchdog abandon or report a request on purpose"),
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


# In-process native libraries' logs (Mooncake's glog) go to files, one per test
# (sglang_l3.testing.native_logs); a failing test's report names its file.
_NATIVE_LOGS = None


@pytest.fixture(scope="session", autouse=True)
def _native_logs(tmp_path_factory: pytest.TempPathFactory) -> None:
    global _NATIVE_LOGS
    from sglang_l3.testing import native_logs

    d = native_logs.route(tmp_path_factory.getbasetemp() / "native-logs")
    _NATIVE_LOGS = native_logs.Slices(d)
    _NATIVE_LOGS.mark()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _NATIVE_LOGS is not None:
        _NATIVE_LOGS.mark()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    rep = yield
    if _NATIVE_LOGS is None or not (rep.failed or rep.when == "teardown"):
        return rep
    path = _NATIVE_LOGS.save(item.nodeid)  # what this test's phases wrote so far
    if rep.failed:
        rep.sections.append(
            (
                "native library logs",
                f"in-process Mooncake (glog) lines written during this test: {path}"
                if path
                else f"no in-process native log lines during this test (all of them: {_NATIVE_LOGS.dir})",
            )
        )
    return rep


# Parallel runs (run_suite.py: pytest-xdist, --dist loadgroup, collection order kept;
# the groups are read by `pytest_xdist_make_scheduler` below).
# Files that start servers go first, slowest first (by their time on the 2-core
# development VM), so that the two workers finish together; unit tests, which
# share nothing, are spread one by one at the end.
SLOW_FIRST = (
    "e2e/test_tp2_l3.py",
    "agents/test_hermes_l3_restart.py",
    "e2e/test_tp2_streamed_server.py",
    "e2e/test_burst_server.py",
    "e2e/test_images_server.py",
    "e2e/test_openai_client.py",
    "e2e/test_scripted_decode_server.py",
    "e2e/test_sessions_server.py",
    "agents/test_hermes_compression.py",
    "e2e/test_implicit_sessions_server.py",
    "e2e/test_tool_pins_server.py",
    "e2e/test_many_agents_server.py",
    "e2e/test_mooncake_servers.py",
    "e2e/test_idle_server.py",
    "e2e/test_l3_restore_server.py",
    "e2e/test_streamed_server.py",
    "e2e/test_startup_errors.py",
    "e2e/test_metrics_server.py",
    "e2e/test_flush_restore_server.py",
    "e2e/test_runtime_attach.py",
    "e2e/test_top_server.py",
    "e2e/test_bad_request.py",
    "e2e/test_plan_server.py",
    "integration/test_fault_controls.py",
)
_HERE = os.path.dirname(os.path.abspath(__file__))


def _rel(item: pytest.Item) -> str:
    return os.path.relpath(str(item.path), _HERE).replace(os.sep, "/")


def xdist_group(rel: str) -> str | None:
    """The group a test file's tests run in, on one worker, in file order (None:
    each test on its own). A file is one group: module/session fixtures (shared
    servers, `_CLUSTERS` in e2e/conftest.py) and tests that build on earlier ones
    stay together. The TP=2 files share one group: two TP=2 servers at once do
    not fit two shared cores. The Qwen3.5 image files share their servers
    (mm_e2e.shared_servers)."""
    if rel.startswith("unit/"):
        # test_layering's negative controls write probe modules into the package,
        # which its scan must not see from the other worker
        return rel if rel == "unit/test_layering.py" else None
    if rel.startswith("e2e/test_tp2_"):
        return "e2e-tp2"
    if rel in ("e2e/test_images_server.py", "e2e/test_openai_client.py"):
        return "e2e-qwen35-mm"
    return rel


def xdist_scope(nodeid: str) -> str:
    """The work unit of one test: its group, where the test's TP=2 cases of
    test_burst_server join the TP=2 files (its TP=1 cases stay a group of their own)."""
    path = nodeid.split("::", 1)[0]
    rel = path[len("test/") :] if path.startswith("test/") else path  # rootdir test/ or the repo
    if rel == "e2e/test_burst_server.py" and "[tp2" in nodeid:
        return "e2e-tp2"
    return xdist_group(rel) or nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` with our groups, read from the nodeid's file. pytest-xdist
    3.8's own loadgroup tags each nodeid with its group (`item._nodeid = ...@group`);
    pytest 9 no longer reads `_nodeid` (Node.nodeid is `_id`), so every test became
    its own group and one file's tests, with their shared servers, ran on both
    workers at once."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return GroupScheduling(config, log)


_DIRS = ("e2e", "agents", "integration", "upstream", "unit")


def _order(rel: str) -> int:
    if rel in SLOW_FIRST:
        return SLOW_FIRST.index(rel)
    top = rel.split("/")[0]
    return len(SLOW_FIRST) + (_DIRS.index(top) if top in _DIRS else len(_DIRS))


@pytest.fixture(autouse=True)
def _no_l3_wait_abandoned(request: pytest.FixtureRequest):
    """The L3 wait watchdog's counters must stay 0: a request it abandoned (verify
    mode) or reported (detect mode, `l3_wait_overdue`) waited on L3 past its budget.
    Servers' counters: tp2_e2e.generate."""
    from sglang_l3 import metrics

    names = ("l3_wait_abandoned", "l3_wait_overdue")
    before = [metrics.get(n) for n in names]
    yield
    if request.node.get_closest_marker("l3_wait_abandoned_expected") is not None:
        return
    for name, b in zip(names, before, strict=True):
        if metrics.get(name) != b:
            pytest.fail(f"{name} rose by {metrics.get(name) - b}: a request waited on L3 past its budget")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rels = {id(item): _rel(item) for item in items}
    items.sort(key=lambda item: _order(rels[id(item)]))  # stable: file order kept
    for item in items:
        group = xdist_group(rels[id(item)])
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
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
