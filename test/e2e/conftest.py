"""End-to-end: real `python -m sglang.launch_server` processes serving the
packaged tiny Qwen3-Next with buffer-only HiCache over the `file` L3 backend.

Every server is started and stopped here (free loopback port, start-up
timeout, process-group kill). Servers are shared across tests where the
scenario allows: per device, one "first" server (large device pool) and, after
it is stopped, one "restarted" server over the same store (small device pool).
Assertions read the server's own per-request metadata (`cached_tokens_details`:
device / host / storage), never its logs.

Variants: `cpu` (default suite; needs no accelerator, skipped where one is
present because the cpu-serving patches are not applicable there) and `cuda`
(marked `gpu`; skipped without a CUDA device).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from l3_e2e import (
    CHUNKED_PREFILL,
    LARGE_POOL,
    NEW_TOKENS,
    PAGE_SIZE,
    PREFETCH_THRESHOLD,
    SMALL_POOL,
    STARTUP_TIMEOUT,
    P,
    run_agents,
)
from sglang_l3.testing.server import Server, ServerConfig, warm_hicache_hash_extension


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


@dataclass
class Cluster:
    """The servers of one device variant, in the order the scenarios need them."""

    device: str
    root: Path
    store: Path
    first_server: Optional[Server] = None
    restarted_server: Optional[Server] = None
    results: dict[str, Any] = field(default_factory=dict)
    _stopped_first: bool = False
    _failed: dict[str, str] = field(default_factory=dict)

    def _start(self, name: str, pool: int) -> Server:
        # a server that failed to start is not retried by every later test
        if name in self._failed:
            pytest.fail(f"{name} server failed to start earlier: {self._failed[name][:2000]}")
        try:
            return Server(self.config(pool), self.root / f"{name}.log", startup_timeout=STARTUP_TIMEOUT).start()
        except Exception as e:
            self._failed[name] = str(e)
            raise

    def config(self, pool: int, **kw: Any) -> ServerConfig:
        return ServerConfig(
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


_CLUSTERS: dict[str, Cluster] = {}


@pytest.fixture(scope="session")
def hash_extension_built() -> None:
    warm_hicache_hash_extension()


@pytest.fixture(scope="session")
def clusters(tmp_path_factory: pytest.TempPathFactory):
    yield _CLUSTERS
    for c in _CLUSTERS.values():
        c.stop()


@pytest.fixture
def cluster(request: pytest.FixtureRequest, clusters, tmp_path_factory, hash_extension_built) -> Cluster:
    device = request.param
    if device == "cpu" and _accelerator():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    if device == "cuda" and not _cuda():
        pytest.skip("no CUDA device")
    if device not in clusters:
        root = tmp_path_factory.mktemp(f"e2e-{device}")
        clusters[device] = Cluster(device=device, root=root, store=root / "store")
    return clusters[device]


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
