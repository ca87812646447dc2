"""No "Removing stale PyTorch extension lock" warning in every fresh process
(patch quiet-extension-lock): torch 2.14 leaves its FileLock file behind by
design. Subprocesses, because the extension loads once per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang.srt.utils.cpp_extension_loader import _get_build_directory

pytestmark = pytest.mark.slow  # two fresh processes

CODE = "from sglang_l3.testing.server import warm_hicache_hash_extension as w; w()"
MESSAGE = "Removing stale PyTorch extension lock"


def _load(disable: str) -> str:
    lock = Path(_get_build_directory("hicache_hash_cpp")) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()  # what torch's FileLock leaves after every load
    env = dict(os.environ, SGLANG_L3_DISABLE=disable)
    out = subprocess.run(
        [sys.executable, "-c", CODE],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def test_no_stale_lock_warning() -> None:
    assert MESSAGE not in _load("")


def test_negative_control_without_patch_warns() -> None:
    assert MESSAGE in _load("quiet-extension-lock")
