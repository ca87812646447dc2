"""`sglang-l3 plan`'s pool sizes are the ones a real server allocates: for each
packaged tiny model, a CPU server started with the plan's own launch flags logs
the device KV tokens, the Mamba slots, the running-request cap, the host staging
pools (KV tokens and state slots), the store's page sizes and its byte cap that
the plan predicted. One server per model, started and stopped (no requests)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from sglang_l3.plan import models
from sglang_l3.plan.planner import Inputs, make_plan
from sglang_l3.testing import forked_launcher
from sglang_l3.testing.server import Server, ServerConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MiB = 1 << 20


def _logged(log: str, pattern: str) -> int:
    m = re.findall(pattern, log)
    assert m, f"no line matching {pattern!r} in the server log"
    return int(m[-1])


@pytest.mark.parametrize("model", models.TINY)
def test_a_server_started_with_the_plans_flags_has_its_pools(tmp_path: Path, model: str, monkeypatch) -> None:
    # the command line itself, as the user runs it (not the suite's launcher fork server)
    monkeypatch.setenv(forked_launcher.ENV, "0")
    name, config, source = models.load(model)
    store = tmp_path / "store"
    plan = make_plan(
        Inputs(
            model=name,
            config=config,
            model_source=source,
            tp=1,
            gpu_mem=32 * MiB,
            host_ram=64 << 30,
            nvme=256 * MiB,
            agents=2,
            context=2048,
            page_size=64,
            checkpoint_interval=512,
            store_dir=str(store),
        )
    )
    flags = [a for f in plan.flags for a in shlex.split(f)]
    cfg = ServerConfig(
        model=model,
        storage_dir=str(store),
        # ServerConfig's own sizing flags come first; the plan's, later, win
        extra_args=flags + ["--hicache-storage-backend-extra-config", json.dumps(plan.store_config)],
    )
    server = Server(cfg, tmp_path / "server.log")
    with server:
        log = server.log_text()
    assert _logged(log, r"KV Cache is allocated\..*#tokens: (\d+)") == plan.device_kv_tokens
    assert _logged(log, r"Mamba Cache is allocated\. max_mamba_cache_size: (\d+)") == plan.device_mamba_slots
    assert _logged(log, r"max_total_num_tokens=\d+, .*max_running_requests=(\d+)") == plan.max_running_requests
    assert _logged(log, r"hierarchical KV host pool: (\d+) tokens") == plan.host_kv_tokens
    assert _logged(log, r"hierarchical Mamba cache \((\d+) state slots") == plan.host_mamba_slots
    assert _logged(log, r"sglang-l3 store: pool kv: (\d+)-byte pages") == plan.kv_bytes_per_token * 64
    assert _logged(log, r"sglang-l3 store: pool mamba: (\d+)-byte pages") == plan.state_bytes
    assert _logged(log, r"eviction enabled: cap=(\d+) B") == plan.l3_cap
