"""`--hicache-mem-layout buffer_only` (patch cli-buffer-only)."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys

import pytest
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang_l3.patches import framework
from sglang_l3.patches.cli import buffer_only as cli_buffer_only

BASE = ["--model-path", "dummy", "--enable-hierarchical-cache", "--hicache-storage-backend", "file"]


def _spec():
    return next(s for s in framework.load_series() if s.id == "cli-buffer-only")


@pytest.fixture(autouse=True)
def applied():
    framework.apply_one(_spec())
    yield
    framework.apply_one(_spec())  # re-apply after a negative control


def test_buffer_only_layout_means_buffer_only_mode() -> None:
    sa = prepare_server_args(BASE + ["--hicache-mem-layout", "buffer_only"])
    assert sa.hicache_host_memory_mode == "buffer_only"
    assert sa.hicache_mem_layout == "page_first_direct"
    assert sa.hicache_io_backend == "direct"
    assert type(sa.hicache_io_backend) is str


def test_explicit_matching_mode_is_fine() -> None:
    sa = prepare_server_args(
        BASE + ["--hicache-host-memory-mode", "buffer_only", "--hicache-mem-layout", "buffer_only"]
    )
    assert (sa.hicache_host_memory_mode, sa.hicache_mem_layout) == ("buffer_only", "page_first_direct")


@pytest.mark.parametrize("order", ["layout-first", "mode-first"])
def test_contradiction_is_a_clear_startup_error(order: str) -> None:
    a, b = ["--hicache-mem-layout", "buffer_only"], ["--hicache-host-memory-mode", "cache"]
    argv = BASE + (a + b if order == "layout-first" else b + a)
    with pytest.raises(SystemExit, match="contradicts --hicache-host-memory-mode cache"):
        prepare_server_args(argv)


def test_other_layouts_untouched() -> None:
    sa = prepare_server_args(BASE + ["--hicache-mem-layout", "page_first"])
    assert (sa.hicache_host_memory_mode, sa.hicache_mem_layout) == ("cache", "page_first")
    sa = prepare_server_args(
        BASE + ["--hicache-host-memory-mode", "buffer_only", "--hicache-mem-layout", "page_first_direct"]
    )
    assert sa.hicache_host_memory_mode == "buffer_only"


def test_rocm_forces_direct_and_rejects_kernel(monkeypatch) -> None:
    monkeypatch.setattr(cli_buffer_only, "is_rocm", lambda: True)
    sa = prepare_server_args(BASE + ["--hicache-mem-layout", "buffer_only"])
    assert sa.hicache_io_backend == "direct"
    with pytest.raises(SystemExit, match="PR #38967"):
        prepare_server_args(BASE + ["--hicache-mem-layout", "buffer_only", "--hicache-io-backend", "kernel"])


def test_programmatic_server_args_translate_at_resolution() -> None:
    sa = ServerArgs(model_path="dummy", hicache_mem_layout="buffer_only", hicache_storage_backend="file")
    fired = dict(framework.get_status("cli-buffer-only").fired)
    with contextlib.suppress(Exception):  # later handlers need a real model; translation runs first
        sa.resolve_once()
    assert sa.hicache_host_memory_mode == "buffer_only"
    assert sa.hicache_mem_layout == "page_first_direct"
    assert framework.get_status("cli-buffer-only").fired.get("resolve_once", 0) > fired.get("resolve_once", 0)


def test_help_lists_the_choice() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    text = parser.format_help()
    assert "buffer_only" in text and "sglang-l3" in text


def test_negative_control_patch_disabled_rejects_choice() -> None:
    framework.undo("cli-buffer-only")
    with pytest.raises(SystemExit) as e:
        prepare_server_args(BASE + ["--hicache-mem-layout", "buffer_only"])
    assert e.value.code == 2  # argparse: invalid choice


@pytest.mark.slow
@pytest.mark.parametrize("disabled", [False, True])
def test_real_launcher_help_through_the_plugin(disabled: bool) -> None:
    """`python -m sglang.launch_server --help` loads our plugin via its entry point."""
    env = dict(os.environ)
    env.pop("SGLANG_L3_CPU_SERVING", None)
    if disabled:
        env["SGLANG_L3_DISABLE"] = "cli-buffer-only"
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    layout_help = out.stdout[out.stdout.index("--hicache-mem-layout") :][:600]
    assert ("buffer_only" in layout_help) is (not disabled)
