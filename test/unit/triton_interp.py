"""Run a test module's `_child(out_path)` under TRITON_INTERPRET=1 in a fresh
interpreter (the variable is read when Triton is imported) and return its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_child(module_file: str, out_path: str) -> dict[str, Any]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run(
        [sys.executable, os.path.abspath(module_file), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, f"interpreter child failed:\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    with open(out_path) as f:
        return json.load(f)
