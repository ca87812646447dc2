"""The radix-tree core against the installed torch (sglang_l3.tree_core): the Rust core
is compiled against the torch the sglang wheel pins and panicked next to torch 2.11 on
the borrowed GPU; doctor says so, and the test harness runs the Python core there."""

from __future__ import annotations

import pytest
import torch
from sglang_l3 import doctor, tree_core


def test_the_pin_is_read_from_sglangs_metadata() -> None:
    assert tree_core.sglang_torch_pin() == "2.14.1"


def test_matching_torch_keeps_the_rust_core(monkeypatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    assert tree_core.rust_core_mismatch() is None
    monkeypatch.delenv(tree_core.ENV, raising=False)
    c = doctor.check_tree_core()
    assert c.ok and c.data == {"selected": "rust", "rust_mismatch": None}


def test_another_torch_is_a_mismatch_doctor_fails_until_python_is_selected(monkeypatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    why = tree_core.rust_core_mismatch()
    assert why is not None and "2.14.1" in why and "2.11.0+cu130" in why
    monkeypatch.delenv(tree_core.ENV, raising=False)
    c = doctor.check_tree_core()
    assert not c.ok and f"{tree_core.ENV}=python" in c.detail
    monkeypatch.setenv(tree_core.ENV, "python")
    c = doctor.check_tree_core()
    assert c.ok and c.detail.startswith("python (")


def test_the_stack_runs_the_python_core_where_rust_does_not_match(monkeypatch, tmp_path) -> None:
    import sglang_l3.testing.stack as stack

    monkeypatch.setattr(stack, "TREE_CORES", ("python",))
    with stack.L3Stack(stack.HybridSpec(page_size=4), str(tmp_path), tree_core="rust") as st:
        assert st.cache._tree_core_backend == "python"
    with pytest.raises(ValueError, match="tree_core must be one of"):
        stack.L3Stack(stack.HybridSpec(page_size=4), str(tmp_path), tree_core="go")


def test_a_cpu_stack_without_the_cpu_switch_says_what_to_do(monkeypatch) -> None:
    """A CPU stack needs the CPU switch's transfer ops; without it (e.g. on a machine
    with a GPU) the stack stops at once naming SGLANG_L3_TEST_DEVICE=cuda, instead of
    failing later inside upstream's host pools."""
    import sglang_l3.cpu
    import sglang_l3.testing.stack as stack
    from sglang_l3.patches import framework

    monkeypatch.setattr(framework, "is_applied", lambda pid: False)
    monkeypatch.setattr(sglang_l3.cpu, "enabled", lambda: False)
    with pytest.raises(RuntimeError, match="needs the CPU switch.*SGLANG_L3_TEST_DEVICE=cuda"):
        stack.ensure_cpu_host_pools()
