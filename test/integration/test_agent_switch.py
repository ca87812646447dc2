"""benchmark/agent_switch.py end to end at a tiny context (issue 50 item 1): two
Qwen3.5-27B rank contexts of 1,024 tokens (real per-rank geometry, a few pages),
two switches. The run exits 0 under a generous --max-ratio, and its last line says
every switch was exact, every resident's turn reached L3, and the arriving context
waited for the resident's newest rows (write_wait_ms > 0: by construction it needs
them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAST = re.compile(
    r"^switch_vs_store=(?P<ratio>\S+) write_wait_ms=(?P<wait>\S+) a_pages_in_l3=(?P<l3>yes|no) "
    r"exact=(?P<exact>yes|no) switches=(?P<n>\d+) context=(?P<context>\d+)$"
)


@pytest.mark.slow
def test_agent_switch_at_a_tiny_context(tmp_path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmark" / "agent_switch.py"), "--context", "1024", "--turn", "256"]
    cmd += ["--switches", "2", "--buffer", "0.5", "--dir", str(tmp_path), "--max-ratio", "1000"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    log = out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and lines, log
    m = LAST.match(lines[-1])
    assert m is not None, log
    assert m["l3"] == "yes" and m["exact"] == "yes", log
    assert m["n"] == "2" and m["context"] == "1024", log
    assert 0 < float(m["ratio"]) < 1000 and float(m["wait"]) > 0, log
    rows = [line.split() for line in lines if re.match(r"^\s+[12] ", line)]
    assert [r[1] for r in rows] == ["A->B", "B->A"], log
    assert all(r[-3:] == ["True", "True", "True"] for r in rows), log
    assert "bench-check passed" in lines[-2], log
