"""The CPU patches (group cpu-serving, cpu-host-pools) apply only when asked
(SGLANG_L3_CPU_SERVING=1 or sglang_l3.cpu.enable()), never merely because no
accelerator is present; cpu-host-pools comes in through `requires`, not because
another patch applies it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import sglang_l3.cpu
from sglang_l3.patches import cpu_host_pools, cpu_serving, framework

CPU_IDS = (
    "cpu-host-pools",
    "cpu-gdn-torch",
    "cpu-qwen3next-ops",
    "cpu-device-module",
    "cpu-rope-native",
    "cpu-extra-buffer",
    "cpu-pin-memory",
    "cpu-moe-gate",
    "cpu-attention-invariant",
    "cpu-linear-invariant",
)

# A fresh process as SGLang starts one: the plugin applies the queue.
PROBE = """
import json, torch
original_pin = torch.Tensor.pin_memory
import sglang_l3.plugin
sglang_l3.plugin.register()
from sglang_l3.patches import framework
print("RESULT " + json.dumps({
    "states": {k: v.state.value for k, v in framework.status().items()},
    "details": {k: v.detail for k, v in framework.status().items()},
    "pin_memory_replaced": torch.Tensor.pin_memory is not original_pin,
}))
"""


def _probe(switch: str | None) -> dict:
    env = dict(os.environ)
    env.pop(sglang_l3.cpu.ENV_SWITCH, None)
    if switch is not None:
        env[sglang_l3.cpu.ENV_SWITCH] = switch
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.fixture
def no_accelerator() -> None:
    if sglang_l3.cpu.accelerator_present():
        pytest.skip("this checks a machine without an accelerator")


def test_without_the_switch_a_process_without_accelerator_is_untouched(no_accelerator) -> None:
    r = _probe(None)
    for pid in CPU_IDS:
        assert r["states"][pid] == "not applicable", (pid, r["states"][pid], r["details"][pid])
    assert "SGLANG_L3_CPU_SERVING=1" in r["details"]["cpu-host-pools"]
    assert r["pin_memory_replaced"] is False
    # the rest of the queue is unaffected
    assert r["states"]["store-file"] == "applied"


def test_with_the_switch_the_group_and_its_requirement_apply(no_accelerator) -> None:
    r = _probe("1")
    for pid in CPU_IDS:
        assert r["states"][pid] == "applied", (pid, r["details"][pid])
    assert r["pin_memory_replaced"] is True


def test_applicability_reads_the_switch(no_accelerator, monkeypatch) -> None:
    monkeypatch.delenv(sglang_l3.cpu.ENV_SWITCH, raising=False)
    assert cpu_serving.applicable() and cpu_host_pools.applicable()
    monkeypatch.setenv(sglang_l3.cpu.ENV_SWITCH, "0")
    assert cpu_serving.applicable()
    sglang_l3.cpu.enable()
    assert os.environ[sglang_l3.cpu.ENV_SWITCH] == "1"
    assert cpu_serving.applicable() is None and cpu_host_pools.applicable() is None


def test_cpu_serving_does_not_apply_host_pools_itself(no_accelerator, monkeypatch) -> None:
    """With cpu-host-pools disabled, the group reports the missing requirement and
    the host pools stay upstream's (formerly cpu-gdn-torch applied them itself)."""
    env = dict(os.environ, SGLANG_L3_DISABLE="cpu-host-pools", SGLANG_L3_CPU_SERVING="1")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    assert r["states"]["cpu-host-pools"] == "disabled"
    assert r["states"]["cpu-gdn-torch"] == "not applicable"
    assert r["details"]["cpu-gdn-torch"] == "requires cpu-host-pools (disabled: SGLANG_L3_DISABLE)"


def test_in_process_queue_state() -> None:
    """This test session asked for the CPU patches (test/conftest.py)."""
    if sglang_l3.cpu.accelerator_present():
        pytest.skip("no CPU patches next to an accelerator")
    assert all(framework.is_applied(pid) for pid in CPU_IDS)


def test_stack_applies_host_pools_when_only_enable_was_called(no_accelerator) -> None:
    """enable() alone (no plugin.register()) then the CPU cache stack: it applies
    cpu-host-pools itself, as enable() did before it became a switch only."""
    probe = (
        "import sglang_l3.cpu; sglang_l3.cpu.enable()\n"
        "from sglang_l3.patches import framework\n"
        "assert not framework.is_applied('cpu-host-pools')\n"
        "from sglang_l3.testing.stack import ensure_cpu_host_pools\n"
        "ensure_cpu_host_pools()\n"
        "print('RESULT', framework.is_applied('cpu-host-pools'))\n"
    )
    env = dict(os.environ)
    env.pop(sglang_l3.cpu.ENV_SWITCH, None)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT True" in out.stdout
