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
