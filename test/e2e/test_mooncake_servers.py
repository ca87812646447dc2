"""Contexts shared across servers through Mooncake: real `launch_server` processes.

One loopback Mooncake store (master + storage node, sglang_l3.testing.mooncake)
and CPU servers of the packaged tiny Qwen3-Next with
`--hicache-storage-backend mooncake --hicache-mem-layout buffer_only`, each a
separate process on its own port (two "nodes"), joining with
`global_segment_size=0` so pages live on the storage node:

1. server A computes prompts P and Q (its answers are the no-cache reference:
   nothing was cached, `cached_tokens == 0`);
2. server B, started while A runs, gets P: restored from Mooncake
   (`cached_tokens_details.storage`), identical tokens and logprobs;
3. A is stopped; B gets Q (written by A only): still restored, identical;
4. server C with another dtype (`--dtype float16`, fp16 conv state) on the same master gets P:
   a miss (patch mooncake-identity; without it C reads A's bf16 pages).

Every server and the store are stopped by PID in fixture teardown. Skipped with
the reason when Mooncake is not installed, unless SGLANG_L3_REQUIRE_MOONCAKE=1.
Three server starts (1-3 min each here).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from l3_e2e import (
    CHUNKED_PREFILL,
    LARGE_POOL,
    NEW_TOKENS,
    P_LEN,
    PAGE_SIZE,
    PREFETCH_THRESHOLD,
    STARTUP_TIMEOUT,
    P,
    assert_same_output,
    restorable,
)
from mooncake_support import require_mooncake
from sglang_l3.testing import mooncake as mc
from sglang_l3.testing.server import (
    Generation,
    Server,
    ServerConfig,
    prompt,
    warm_hicache_hash_extension,
)

pytestmark = pytest.mark.e2e

Q_LEN = 330
Q = prompt(3, Q_LEN)


@dataclass
class Nodes:
    store: mc.MooncakeCluster
    root: Path
    servers: dict[str, Server] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def server(self, name: str, *extra_args: str, env: dict[str, str] | None = None) -> Server:
        if name in self.failed:
            pytest.fail(f"server {name} failed to start earlier: {self.failed[name][:2000]}")
        if name not in self.servers:
            cfg = ServerConfig(
                storage_backend="mooncake",
                storage_extra_config=self.store.extra_config(),
                max_total_tokens=LARGE_POOL,
                chunked_prefill_size=CHUNKED_PREFILL,
                prefetch_threshold=PREFETCH_THRESHOLD,
                page_size=PAGE_SIZE,
                # explicit ratio (buffer_only's default): upstream's auto-sizing refuses
                # to start when a busy machine has < 10 GiB free (hicache_auto_size.py)
                extra_args=["--hicache-ratio", "1.2", *extra_args],
                env=dict(env or {}),
            )
            # (the launcher waits for host memory when upstream's 10 GiB reserve is not free)
            s = Server(cfg, self.root / f"{name}.log", startup_timeout=STARTUP_TIMEOUT)
            try:
                self.servers[name] = s.start()
            except Exception as e:
                self.failed[name] = str(e)
                raise
        return self.servers[name]

    def stop(self, name: str) -> None:
        s = self.servers.pop(name, None)
        if s is not None:
            s.stop()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Iterator[Nodes]:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    require_mooncake()
    warm_hicache_hash_extension()
    root = tmp_path_factory.mktemp("e2e-mooncake")
    store = mc.MooncakeCluster(root / "store")
    n = Nodes(store, root)
    try:
        store.start()
        yield n
    finally:
        for name in list(n.servers):
            n.stop(name)  # by PID (process group)
        store.stop()


def _reference(n: Nodes, key: str) -> Generation:
    ref = n.results.get(key)
    if ref is None:
        pytest.skip(f"server A's {key} run did not complete")
    return ref


def test_a_computes_and_writes_through(nodes: Nodes) -> None:
    a = nodes.server("A")
    for key, ids in (("P", P), ("Q", Q)):
        g = a.generate(ids, NEW_TOKENS)
        assert g.cached_tokens == 0, g.meta  # computed: the no-cache reference
        assert len(set(g.output_ids)) > 1, "degenerate dummy weights (one repeated token)"
        nodes.results[key] = g
    # write-through runs after the request; a flush waits for it and drops A's device tree
    a.flush_cache()


def test_b_restores_a_prefix_from_mooncake(nodes: Nodes) -> None:
    want = _reference(nodes, "P")
    assert "A" in nodes.servers, "server A should still be running"
    b = nodes.server("B")
    got = b.generate(P, NEW_TOKENS)
    assert got.cached_device == 0 and got.cached_host == 0, got.meta
    assert got.cached_storage == restorable(P_LEN), got.meta
    assert_same_output(got, want, "cpu", "P on server B, restored from A's pages")


def test_b_restores_after_a_stopped(nodes: Nodes) -> None:
    want = _reference(nodes, "Q")
    nodes.stop("A")
    b = nodes.server("B")
    got = b.generate(Q, NEW_TOKENS)
    assert got.cached_device == 0, got.meta
    assert got.cached_storage == restorable(Q_LEN), got.meta
    assert_same_output(got, want, "cpu", "Q on server B after A stopped")


def test_foreign_dtype_server_misses(nodes: Nodes) -> None:
    _reference(nodes, "P")
    nodes.stop("B")  # one server at a time on a 2-core machine
    # fp16 model and KV; the Mamba conv state follows (SGLang's default is bf16 for
    # it, which an fp16 forward cannot write into). Same page bytes as A's bf16 pages.
    c = nodes.server("C", "--dtype", "float16", env={"SGLANG_MAMBA_CONV_DTYPE": "float16"})
    got = c.generate(P, NEW_TOKENS)
    assert got.cached_storage == 0, f"an fp16 server restored bf16 pages: {got.meta}"
    assert got.cached_tokens == 0, got.meta


def test_store_processes_listen_on_loopback(nodes: Nodes) -> None:
    """Master and storage-node service ports on 127.0.0.1; the only others are
    the transfer engine's all-interfaces listeners (no option narrows them)."""
    master = nodes.store.master_listeners()
    assert master and all(lst.loopback for lst in master), master
    exposed = [lst for lst in mc.listeners(nodes.store.pids()) if not lst.loopback]
    assert all(mc.transfer_engine_listener(lst) for lst in exposed), exposed
