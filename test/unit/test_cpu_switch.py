"""The CPU patches (groups cpu and cpu-serving in series.toml, and what they
require) apply only when asked (SGLANG_L3_CPU_SERVING=1 or sglang_l3.cpu.enable()),
never merely because no accelerator is present, and never next to one, even with
every opt-in set; cpu-host-pools comes in through `requires`, not because another
patch applies it."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import sglang_l3.cpu
from sglang_l3.patches import framework
from sglang_l3.patches.cpu import host_pools as cpu_host_pools
from sglang_l3.patches.cpu_serving import kernels as cpu_serving

# The CPU patches, from series.toml: the groups `cpu` (cpu-host-pools, cpu-sim-streams)
# and `cpu-serving`, and whatever those require.
SERIES = framework.load_series()
CPU_GROUPS = ("cpu", "cpu-serving")


def _cpu_ids() -> tuple[str, ...]:
    by_id = {s.id: s for s in SERIES}
    ids = {s.id for s in SERIES if s.group in CPU_GROUPS}
    todo = list(ids)
    while todo:
        for rid in by_id[todo.pop()].requires:
            if rid not in ids:
                ids.add(rid)
                todo.append(rid)
    return tuple(sorted(ids))


CPU_IDS = _cpu_ids()
# not applied by the switch alone: cpu-sim-streams also needs SGLANG_L3_SIM_STREAMS,
# scripted-decode SGLANG_L3_SCRIPTED_DECODE (a test script)
OPT_IN = ("cpu-sim-streams", "scripted-decode")

# Every probe is a fresh process as SGLang starts one (the plugin applies the queue).
# The slow imports they share (torch, sglang's utils) happen once; each probe is then
# a forked child with its own environment, all at once (the file was ~5 min as
# separate processes).
PROBES = r"""
import json, os, sys
import torch
import sglang.srt.utils  # noqa: F401  (the shared, slow part)

def register(fake_accelerator):
    original_pin = torch.Tensor.pin_memory
    import sglang_l3.cpu
    if fake_accelerator:  # what the switch reads next to a GPU
        sglang_l3.cpu.accelerator_present = lambda: True
    import sglang_l3.plugin
    sglang_l3.plugin.register()
    from sglang_l3 import faults
    from sglang_l3.patches import framework
    return {
        "states": {k: v.state.value for k, v in framework.status().items()},
        "details": {k: v.detail for k, v in framework.status().items()},
        "pin_memory_replaced": torch.Tensor.pin_memory is not original_pin,
        "faults_honoured": faults.honoured(),
    }

def stack():
    import sglang_l3.cpu; sglang_l3.cpu.enable()
    from sglang_l3.patches import framework
    before = framework.is_applied("cpu-host-pools")
    from sglang_l3.testing.stack import ensure_cpu_host_pools
    ensure_cpu_host_pools()
    return {"before": before, "after": framework.is_applied("cpu-host-pools")}

configs, outdir = json.loads(sys.argv[1]), sys.argv[2]
pids = {}
for name, (env, kind) in configs.items():
    pid = os.fork()
    if pid == 0:
        for k in ("SGLANG_L3_CPU_SERVING", "SGLANG_L3_SIM_STREAMS", "SGLANG_L3_DISABLE"):
            os.environ.pop(k, None)
        os.environ.update(env)
        try:
            out = stack() if kind == "stack" else register(kind == "accelerator")
        except BaseException as e:
            import traceback
            out = {"error": traceback.format_exc()}
        with open(os.path.join(outdir, name + ".json"), "w") as f:
            json.dump(out, f)
        os._exit(0)
    pids[name] = pid
for pid in pids.values():
    os.waitpid(pid, 0)
"""

CONFIGS = {
    "no-switch": ({}, "register"),
    "switch": ({sglang_l3.cpu.ENV_SWITCH: "1"}, "register"),
    # a GPU machine with every opt-in set: nothing of the CPU groups may apply
    "accelerator": ({sglang_l3.cpu.ENV_SWITCH: "1", "SGLANG_L3_SIM_STREAMS": "1"}, "accelerator"),
    "host-pools-disabled": ({sglang_l3.cpu.ENV_SWITCH: "1", "SGLANG_L3_DISABLE": "cpu-host-pools"}, "register"),
    "stack": ({}, "stack"),
}


@functools.cache
def _probes() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k not in (sglang_l3.cpu.ENV_SWITCH, "SGLANG_L3_SIM_STREAMS")}
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run(
            [sys.executable, "-c", PROBES, json.dumps(CONFIGS), out],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        got = {}
        for name in CONFIGS:
            path = Path(out) / f"{name}.json"
            assert path.exists(), f"probe {name} wrote nothing:\n{run.stderr[-3000:]}"
            got[name] = json.loads(path.read_text())
    return got


def _probe(name: str) -> dict:
    r = _probes()[name]
    assert "error" not in r, r["error"]
    return r


@pytest.fixture
def no_accelerator() -> None:
    if sglang_l3.cpu.accelerator_present():
        pytest.skip("this checks a machine without an accelerator")


def test_the_cpu_group_comes_from_the_series() -> None:
    assert {"cpu-host-pools", "cpu-gdn-torch", "cpu-qwen35-ops", "cpu-tp-gloo", "cpu-sim-streams"} <= set(CPU_IDS)
    modules = {s.module for s in SERIES if s.id in CPU_IDS}
    assert all(m.startswith(("sglang_l3.patches.cpu.", "sglang_l3.patches.cpu_serving.")) for m in modules), modules


def test_without_the_switch_a_process_without_accelerator_is_untouched(no_accelerator) -> None:
    r = _probe("no-switch")
    for pid in CPU_IDS:
        assert r["states"][pid] == "not applicable", (pid, r["states"][pid], r["details"][pid])
    assert "SGLANG_L3_CPU_SERVING=1" in r["details"]["cpu-host-pools"]
    assert r["pin_memory_replaced"] is False and r["faults_honoured"] is False
    # the rest of the queue is unaffected
    assert r["states"]["store-file"] == "applied"


def test_with_the_switch_the_group_and_its_requirement_apply(no_accelerator) -> None:
    r = _probe("switch")
    for pid in CPU_IDS:
        want = "not applicable" if pid in OPT_IN else "applied"
        assert r["states"][pid] == want, (pid, r["details"][pid])
    assert r["pin_memory_replaced"] is True and r["faults_honoured"] is True


def test_next_to_an_accelerator_nothing_of_the_group_applies() -> None:
    """The switch and the simulator's variable set, and an accelerator present
    (`sglang_l3.cpu.accelerator_present`, what every CPU patch's condition reads)."""
    r = _probe("accelerator")
    for pid in CPU_IDS:
        assert r["states"][pid] == "not applicable", (pid, r["states"][pid], r["details"][pid])
        assert "an accelerator is present" in r["details"][pid] or r["details"][pid].startswith("requires "), (
            pid,
            r["details"][pid],
        )
    assert r["pin_memory_replaced"] is False and r["faults_honoured"] is False
    assert r["states"]["store-file"] == "applied"


def test_applicability_reads_the_switch(no_accelerator, monkeypatch) -> None:
    monkeypatch.delenv(sglang_l3.cpu.ENV_SWITCH, raising=False)
    assert cpu_serving.applicable() and cpu_host_pools.applicable()
    monkeypatch.setenv(sglang_l3.cpu.ENV_SWITCH, "0")
    assert cpu_serving.applicable()
    sglang_l3.cpu.enable()
    assert os.environ[sglang_l3.cpu.ENV_SWITCH] == "1"
    assert cpu_serving.applicable() is None and cpu_host_pools.applicable() is None


def test_cpu_serving_does_not_apply_host_pools_itself(no_accelerator) -> None:
    """With cpu-host-pools disabled, the group reports the missing requirement and
    the host pools stay upstream's (formerly cpu-gdn-torch applied them itself)."""
    r = _probe("host-pools-disabled")
    assert r["states"]["cpu-host-pools"] == "disabled"
    assert r["states"]["cpu-gdn-torch"] == "not applicable"
    assert r["details"]["cpu-gdn-torch"] == "requires cpu-host-pools (disabled: SGLANG_L3_DISABLE)"


def test_in_process_queue_state() -> None:
    """This test session asked for the CPU patches (test/conftest.py)."""
    if sglang_l3.cpu.accelerator_present():
        pytest.skip("no CPU patches next to an accelerator")
    assert all(framework.is_applied(pid) for pid in CPU_IDS if pid not in OPT_IN)


def test_stack_applies_host_pools_when_only_enable_was_called(no_accelerator) -> None:
    """enable() alone (no plugin.register()) then the CPU cache stack: it applies
    cpu-host-pools itself, as enable() did before it became a switch only."""
    assert _probe("stack") == {"before": False, "after": True}
