"""`--measure DIR`: the disk's read speed through the L3 store itself.

Runs the store's own benchmark (benchmark/storage_bench.py, a source checkout's)
on DIR: our store writes and cold-reads Qwen3.5-27B-sized pages; the planner
takes its read GB/s.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmark" / "storage_bench.py"


class MeasureError(RuntimeError):
    pass


def read_gbps(directory: str, size: str = "1GiB", timeout: float = 900.0) -> float:
    if not BENCH.is_file():
        raise MeasureError(f"--measure needs a source checkout's {BENCH}; pass --disk-read-gbps instead")
    if not Path(directory).is_dir():
        raise MeasureError(f"--measure {directory!r} is not a directory")
    cmd = [sys.executable, str(BENCH), "--dir", directory, "--size", size, "--skip-upstream", "--rounds", "1"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise MeasureError(f"--measure: storage_bench.py ran past {timeout:.0f} s") from e
    m = re.search(r"\bread_gbps=([0-9.]+)", run.stdout)
    if run.returncode != 0 or not m:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise MeasureError(f"--measure: storage_bench.py failed (rc {run.returncode}): {' | '.join(tail)}")
    return float(m.group(1))
