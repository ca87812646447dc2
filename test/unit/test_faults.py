"""`sglang_l3.faults` (the test-fault switch, a runtime module the simulator imports): a
test fault is honoured only while the CPU switch or the simulated device is active (never next to an accelerator), an unknown fault is an
error where faults apply, a once-per-process fault stays spent, and a hold lasts
while its gate exists, at most HOLD_S."""

from __future__ import annotations

import pytest
import sglang_l3.cpu
from sglang_l3 import faults


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(faults, "_SPENT", set())
    monkeypatch.setattr(faults, "_HOLD_SINCE", {})
    monkeypatch.delenv(faults.ENV, raising=False)
    if sglang_l3.cpu.accelerator_present():
        pytest.skip("this test session has the CPU switch on (no accelerator)")
    assert sglang_l3.cpu.enabled()  # test/conftest.py


def test_unset_means_no_fault(fresh) -> None:
    assert not any(faults.active(n) for n in faults.NAMES)
    assert faults.argument(faults.STREAM_HOLD) is None and not faults.held()


def test_honoured_with_the_cpu_switch(fresh, monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV, faults.SKIP_LOAD_FENCE)
    assert faults.active(faults.SKIP_LOAD_FENCE) and not faults.active(faults.STREAM_HOLD)
    monkeypatch.setenv(faults.ENV, "restore-fallback@1")
    assert faults.argument(faults.RESTORE_FALLBACK) == "1"
    faults.spend(faults.RESTORE_FALLBACK)
    assert not faults.active(faults.RESTORE_FALLBACK) and faults.argument(faults.RESTORE_FALLBACK) is None


@pytest.mark.parametrize("why", ["switch off", "accelerator"])
def test_ignored_without_the_switch_or_next_to_an_accelerator(fresh, monkeypatch, tmp_path, why: str) -> None:
    if why == "switch off":
        monkeypatch.setenv(sglang_l3.cpu.ENV_SWITCH, "0")
    else:  # a served GPU: the switch may be set, the CPU patches and the faults still do not apply
        monkeypatch.setattr(sglang_l3.cpu, "accelerator_present", lambda: True)
    assert not faults.honoured()
    for value in (faults.SKIP_LOAD_FENCE, f"{faults.STREAM_HOLD}@{tmp_path}", "restore-fallback@0", "typo"):
        monkeypatch.setenv(faults.ENV, value)
        assert not any(faults.active(n) for n in faults.NAMES), value
    assert not faults.held()


def test_several_faults_at_once(fresh, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(faults.ENV, f"{faults.STREAM_HOLD}@{tmp_path},{faults.CUT_NOT_WAIT}")
    assert faults.active(faults.STREAM_HOLD) and faults.active(faults.CUT_NOT_WAIT)
    assert faults.argument(faults.STREAM_HOLD) == str(tmp_path)
    assert faults.argument(faults.CUT_NOT_WAIT) is None
    assert not faults.active(faults.SKIP_LOAD_FENCE)
    monkeypatch.setenv(faults.ENV, f"{faults.CUT_NOT_WAIT},typo")
    with pytest.raises(faults.FaultError, match="unknown fault 'typo'"):
        faults.active(faults.CUT_NOT_WAIT)


def test_unknown_fault_is_an_error_where_faults_apply(fresh, monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV, "skip-load-fences")
    with pytest.raises(faults.FaultError, match="unknown fault 'skip-load-fences'"):
        faults.active(faults.SKIP_LOAD_FENCE)


def test_hold_lasts_while_the_gate_exists_at_most_hold_s(fresh, monkeypatch, tmp_path) -> None:
    gate = tmp_path / "gate"
    monkeypatch.setenv(faults.ENV, f"{faults.STREAM_HOLD}@{gate}")
    assert faults.active(faults.STREAM_HOLD) and not faults.held()
    gate.touch()
    now = [1000.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    assert faults.held()
    now[0] += faults.HOLD_S - 1
    assert faults.held()
    now[0] += 2
    assert not faults.held()  # a forgotten gate does not hang the test forever
    gate.unlink()
    assert not faults.held()
    gate.touch()
    assert faults.held()  # a new gate holds again


def test_read_hold_lets_the_first_k_pieces_through_and_blocks_the_rest(fresh, monkeypatch, tmp_path) -> None:
    import threading

    gate = tmp_path / "gate"
    monkeypatch.setenv(faults.ENV, f"{faults.READ_HOLD}@{gate}")
    faults.hold_read(5)  # no gate: nothing held
    gate.write_text("2")
    faults.hold_read(0)
    faults.hold_read(1)  # the first two pieces pass
    done = threading.Event()
    t = threading.Thread(target=lambda: (faults.hold_read(2), done.set()), daemon=True)
    t.start()
    assert not done.wait(0.3), "piece 2 must wait while the gate exists"
    gate.unlink()
    assert done.wait(30), "removing the gate releases the read"
    t.join(5)


def test_changed_reports_each_change_once(fresh) -> None:
    assert faults.changed("k-test", 1) and not faults.changed("k-test", 1) and faults.changed("k-test", 2)


def test_a_process_without_the_variable_never_loads_the_simulator() -> None:
    """The switch answers "no fault" without importing sglang_l3.sim (a served GPU)."""
    import subprocess
    import sys

    code = (
        "import os, sys; os.environ.pop('SGLANG_L3_TEST_FAULT', None)\n"
        "from sglang_l3 import faults\n"
        "assert not any(faults.active(n) for n in faults.NAMES) and not faults.held()\n"
        "assert faults.argument(faults.STREAM_HOLD) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('sglang_l3.sim')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_simulated_device_reports_itself(fresh, monkeypatch) -> None:
    """With the switch off, faults are honoured while the simulated device is installed
    (the simulator tells the switch; the switch never imports the simulator)."""
    from sglang_l3.sim import streams as sim_streams

    monkeypatch.setenv(sglang_l3.cpu.ENV_SWITCH, "0")
    monkeypatch.setenv(faults.ENV, faults.SKIP_LOAD_FENCE)
    assert not faults.honoured() and not faults.active(faults.SKIP_LOAD_FENCE)
    sim_streams.install(1)
    try:
        assert faults.honoured() and faults.active(faults.SKIP_LOAD_FENCE)
    finally:
        sim_streams.uninstall()
    assert not faults.honoured()
