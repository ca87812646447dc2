"""End-to-end: real `python -m sglang.launch_server` processes serving the
packaged tiny hybrid models with buffer-only HiCache over the `file` L3 backend.

Model families (`family` fixture, l3_e2e.FAMILIES): the suites that matter run on
tiny Qwen3-Next and on tiny Qwen3.5 (multimodal `tiny-qwen35` at TP=1, text-only
`tiny-qwen35-text` in the TP=2 streamed test). A module opts in with
`pytestmark = family_params(...)`; the parameter is session-scoped, so pytest runs
one family's tests together and each family's servers are started once.

No-cache reference (`reference` fixture, `Cluster.expected`): one server per
(device, model) without HiCache. Its answers are memoised by (input ids, new
tokens), so a scenario function (`run_agents`, a conversation) run on it gives a
test the no-cache answer; on its first start it answers every scenario the
collected modules registered (`l3_e2e.reference_scenario`) and it is stopped after
each test, so it starts about once per family and never runs beside an L3
server's start.

Every server is started and stopped here (free loopback port, start-up
timeout, process-group kill). Servers are shared across tests where the
scenario allows: per device, one "first" server (large device pool) and, after
it is stopped, one "restarted" server over the same store (small device pool).
Assertions read the server's own per-request metadata (`cached_tokens_details`:
device / host / storage), never its logs.

Launchers: the e2e tests' servers start from a launcher fork server
(`sglang_l3.testing.forked_launcher`; SGLANG_L3_TEST_FORK_LAUNCHER=0 in the
environment turns it off, docs/testing.md): the same launcher, with its upstream
imports paid once per worker instead of at every start (about 6 s a start quiet).
The scheduler and detokenizer processes are spawned by upstream as always.
`test_startup_errors` (run_to_exit), `test_plan_server` and GPU servers run the
command line itself.

Variants: `cpu` (default suite; needs no accelerator, skipped where one is
present because the cpu-serving patches are not applicable there) and `cuda`
(marked `gpu`; skipped without a CUDA device).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from l3_e2e import (
    CHUNKED_PREFILL,
    LARGE_POOL,
    NEW_TOKENS,
    PAGE_SIZE,
    PREFETCH_THRESHOLD,
    REFERENCE_SCENARIOS,
    SMALL_POOL,
    STARTUP_TIMEOUT,
    P,
    run_agents,
)
from sglang_l3.testing import forked_launcher
from sglang_l3.testing.server import Generation, Server, ServerConfig, warm_hicache_hash_extension

# what an e2e test's servers use: on unless the environment says 0 (docs/testing.md: one
# unexplained TP=2 logprob mismatch in 2026-12-05's runs, none in the full runs since)
_FORK_LAUNCHER = os.environ.get(forked_launcher.ENV, "1")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """e2e tests (only they: this conftest's item hooks) start servers from the
    launcher fork server, the session fixtures they set up included."""
    os.environ[forked_launcher.ENV] = _FORK_LAUNCHER


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    os.environ.pop(forked_launcher.ENV, None)
    if nextitem is None or nextitem.path.parent != item.path.parent:
        forked_launcher.shutdown()  # the worker's e2e tests are done: its imports go


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts real SGLang servers (slow)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run by `run_suite.py --suite gpu`)")


def _accelerator() -> bool:
    from sglang_l3.cpu import accelerator_present

    return accelerator_present()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


class Reference:
    """The no-cache server of one (device, model): same pool, page size and chunked
    prefill as the L3 servers, no HiCache. Answers are memoised. On its first
    start it answers every scenario the collected modules registered
    (l3_e2e.reference_scenario), so it is started about once per family; it is
    stopped after every test (conftest `_family_servers_end`) and before an L3
    server of its family starts, so it never holds memory an L3 server's start-up
    check needs. A dead server (a test that killed it) is started again."""

    def __init__(self, device: str, model: str, root: Path):
        self.device, self.model, self.root = device, model, root
        self._server: Server | None = None
        self._answers: dict[tuple[tuple[int, ...], int], Generation] = {}
        self._done: set[Any] = set()
        self._computing = False
        self._starts = 0

    def config(self) -> ServerConfig:
        return ServerConfig(
            model=self.model,
            storage_dir=None,
            device=self.device,
            max_total_tokens=LARGE_POOL,
            chunked_prefill_size=CHUNKED_PREFILL,
            page_size=PAGE_SIZE,
            # plain sequential scheduling: every L3 server (overlap on, the launcher's
            # default and the user's) must match it
            overlap_schedule=False,
        )

    def server(self) -> Server:
        if self._server is None or not self._server.alive():
            if self._server is not None:
                self._server.stop()
            self._starts += 1
            log = self.root / f"nocache-{self._starts}.log"
            self._server = Server(self.config(), log, startup_timeout=STARTUP_TIMEOUT).start()
        return self._server

    def warm(self) -> None:
        """Answer every registered scenario not answered yet."""
        if self._computing:
            return
        self._computing = True
        try:
            for fn, models in list(REFERENCE_SCENARIOS):
                if fn not in self._done and (models is None or self.model in models):
                    fn(self)
                    self._done.add(fn)
        finally:
            self._computing = False

    def generate(self, ids: list[int], max_new_tokens: int = NEW_TOKENS) -> Generation:
        key = (tuple(ids), max_new_tokens)
        if key not in self._answers:
            self.warm()
        if key not in self._answers:
            g = self.server().generate(ids, max_new_tokens)
            assert g.cached_storage == 0 and g.cached_host == 0, g.meta
            self._answers[key] = g
        return self._answers[key]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class References:
    """The no-cache references, per (device, model)."""

    def __init__(self, root: Path):
        self.root = root
        self._refs: dict[tuple[str, str], Reference] = {}

    def get(self, device: str, model: str) -> Reference:
        key = (device, model)
        if key not in self._refs:
            self._refs[key] = Reference(device, model, self.root / f"{device}-{model}")
        return self._refs[key]

    def stop(self) -> None:
        for r in self._refs.values():
            r.stop()


@dataclass
class Cluster:
    """The L3 servers of one (device, model), in the order the scenarios need them;
    `expected` is that model's no-cache reference."""

    device: str
    model: str
    root: Path
    store: Path
    expected: Reference
    first_server: Server | None = None
    restarted_server: Server | None = None
    results: dict[str, Any] = field(default_factory=dict)
    _stopped_first: bool = False
    _closed: bool = False
    _failed: dict[str, str] = field(default_factory=dict)

    def _start(self, name: str, pool: int) -> Server:
        if self._closed:
            pytest.fail(f"the {self.model} cluster was closed: another family's tests ran in between")
        # a server that failed to start is not retried by every later test
        if name in self._failed:
            pytest.fail(f"{name} server failed to start earlier: {self._failed[name][:2000]}")
        # the no-cache answers first, then that server's memory back (one server at a time)
        self.expected.warm()
        self.expected.stop()
        try:
            return Server(self.config(pool), self.root / f"{name}.log", startup_timeout=STARTUP_TIMEOUT).start()
        except Exception as e:
            self._failed[name] = str(e)
            raise

    def config(self, pool: int, **kw: Any) -> ServerConfig:
        return ServerConfig(
            model=self.model,
            storage_dir=str(self.store),
            device=self.device,
            max_total_tokens=pool,
            chunked_prefill_size=CHUNKED_PREFILL,
            prefetch_threshold=PREFETCH_THRESHOLD,
            page_size=PAGE_SIZE,
            **kw,
        )

    def first(self) -> Server:
        """Large device pool over a fresh store."""
        if self._stopped_first:
            raise RuntimeError("the first server was already stopped for the restart")
        if self.first_server is None:
            self.first_server = self._start("first", LARGE_POOL)
        return self.first_server

    def restarted(self) -> Server:
        """Stop the first server; a new one (small device pool) over the same store."""
        if self.restarted_server is None:
            if self.first_server is not None:
                self.first_server.stop()
            self._stopped_first = True
            self.restarted_server = self._start("restarted", SMALL_POOL)
        return self.restarted_server

    def reference(self, key: str) -> Any:
        """A first-server result a restart test compares against ("P": P computed
        cold; "agents": the interleaved agents on the large pool). Taken from the
        test that recorded it or, when that test did not run (a restart test run
        alone), computed here before the restart. Never a skip: a restart test
        without its reference fails."""
        if key not in self.results:
            if self._stopped_first:
                pytest.fail(f"reference {key!r} was not recorded before the first server stopped")
            s = self.first()
            s.flush_cache()
            if "P" not in self.results:
                self.results["P"] = s.generate(P, NEW_TOKENS)
            if "agents" not in self.results:
                s.flush_cache()
                self.results["agents"] = run_agents(s)
        return self.results[key]

    def stop(self) -> None:
        for s in (self.first_server, self.restarted_server):
            if s is not None:
                s.stop()

    def close(self) -> None:
        """Stop for good (its family's tests are done)."""
        self.stop()
        self._closed = True


_CLUSTERS: dict[str, Cluster] = {}


@pytest.fixture(scope="session")
def hash_extension_built() -> None:
    warm_hicache_hash_extension()


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory):
    refs = References(tmp_path_factory.mktemp("e2e-nocache"))
    yield refs
    refs.stop()


@pytest.fixture(scope="session")
def family(request: pytest.FixtureRequest) -> str:
    """The packaged model of the test's family (l3_e2e.family_params)."""
    return request.param


@pytest.fixture
def reference(family: str, references: References, hash_extension_built) -> Reference:
    """The family's no-cache server on CPU."""
    return references.get("cpu", family)


@pytest.fixture(autouse=True)
def _family_servers_end(request: pytest.FixtureRequest, references: References):
    """No reference server outlives a test (its answers are kept); a test of no
    family means every family's tests have run (they are grouped): the cluster
    servers stop rather than idle to the session's end."""
    if "family" not in request.fixturenames:
        for c in _CLUSTERS.values():
            c.close()
    yield
    references.stop()


@pytest.fixture(scope="session")
def clusters(tmp_path_factory: pytest.TempPathFactory):
    yield _CLUSTERS
    for c in _CLUSTERS.values():
        c.stop()


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, family: str, clusters, references, tmp_path_factory, hash_extension_built
) -> Cluster:
    device = request.param
    if device == "cpu" and _accelerator():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    if device == "cuda" and not _cuda():
        pytest.skip("no CUDA device")
    key = f"{device}-{family}"
    if key not in clusters:
        # one family at a time (the family parameter is session-scoped): a family
        # whose tests have all run gives its servers' memory back
        for c in clusters.values():
            c.close()
        root = tmp_path_factory.mktemp(f"e2e-{key}")
        clusters[key] = Cluster(
            device=device, model=family, root=root, store=root / "store", expected=references.get(device, family)
        )
    return clusters[key]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cluster" in metafunc.fixturenames:
        metafunc.parametrize("cluster", DEVICES, indirect=True)


def _ttfts() -> dict[str, dict]:
    return {device: c.results["ttft"] for device, c in _CLUSTERS.items() if c.results.get("ttft")}


_FROM_WORKERS: dict[str, dict] = {}  # under pytest-xdist the clusters live in the workers


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = getattr(session.config, "workeroutput", None)  # set in an xdist worker
    if out is not None:
        out["e2e_ttft"] = json.dumps(_ttfts())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _FROM_WORKERS.update(json.loads(getattr(node, "workeroutput", {}).get("e2e_ttft", "{}")))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    for device, t in {**_FROM_WORKERS, **_ttfts()}.items():
        if t:
            terminalreporter.write_line(
                f"[e2e {device}] TTFT for a {t['prompt_tokens']}-token prompt: "
                f"{t['ttft_cold_s'] * 1e3:.0f} ms computed, {t['ttft_l3_s'] * 1e3:.0f} ms "
                f"with {t['restored_tokens']} tokens restored from L3"
            )
