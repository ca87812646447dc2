"""test/gpu/device_check.sh --dry-run: the GPU machine's script, its logic checked
here (environment report, GPTQ check harness on the reference path, benchmark
arguments, results under $OUT), without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, SITE=str(tmp_path / "site"))
    out = subprocess.run(
        ["bash", "test/gpu/device_check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "gptq_check: all match" in log and "dry run: logic checked" in log
    assert "--ms" not in log  # the command ran, it was not just echoed
    for name in ("device_check.log", "env.txt", "gptq_check.json", "gptq_bench.txt"):
        assert (tmp_path / name).is_file(), name
    check = json.loads((tmp_path / "gptq_check.json").read_text())
    assert check["device"] == "cpu" and check["failed"] == 0 and check["done"] == check["cases"] > 0
    assert "sglang pin (not needed here)" in (tmp_path / "env.txt").read_text()
