"""`python -m sglang.launch_server` refuses an unusable L3 store or host-memory
budget within seconds (patch startup-checks): exit code 2, and the last line of
its output names the setting and the fix — no traceback, no model loading.

With --hicache-ratio the host pools follow the device pools, so their pinned total
is checked in each rank once those exist, before any host pool is allocated: one
logged line naming the ratio and one that fits, and the server stops.

The time bound is loose on purpose (this may run on a busy 2-core machine): the
launcher must exit well before it could have loaded a model, i.e. within a few
times what importing the launcher takes here, and within 30 s on an idle one.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from sglang_l3.testing.server import Server, ServerConfig

pytestmark = [pytest.mark.e2e]


def _import_seconds() -> float:
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import sglang.launch_server"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def bound() -> float:
    # plugin load (every patch target imported and fingerprinted) + parsing is
    # about 2x the bare import; 4x of it, or 30 s, whichever is larger
    return max(30.0, 4 * _import_seconds())


def _launch(tmp_path: Path, cfg: ServerConfig) -> tuple[int, list[str], float]:
    code, out, seconds = Server(cfg, tmp_path / "server.log").run_to_exit(timeout=600)
    return code, out.strip().splitlines(), seconds


def _check(code: int, lines: list[str], seconds: float, bound: float) -> str:
    assert code == 2, "\n".join(lines[-30:])
    last = lines[-1]
    assert last.startswith("sglang-l3: error:"), last
    assert "Fix" in last, last
    assert not any(line.startswith("Traceback") for line in lines), "\n".join(lines[-30:])
    assert seconds < bound, f"took {seconds:.0f} s (bound {bound:.0f} s)"
    return last


def test_store_dir_is_a_regular_file(tmp_path: Path, bound: float) -> None:
    f = tmp_path / "a-file"
    f.write_text("not a store")
    last = _check(*_launch(tmp_path, ServerConfig(storage_dir=str(f))), bound)
    assert "store_dir" in last and str(f) in last and "not a directory" in last


def test_world_writable_store(tmp_path: Path, bound: float) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    last = _check(*_launch(tmp_path, ServerConfig(storage_dir=str(d))), bound)
    assert "store_dir" in last and f"chmod 700 {d}" in last


def test_cpu_without_max_total_tokens(tmp_path: Path, bound: float) -> None:
    cfg = ServerConfig(storage_dir=str(tmp_path / "store"), max_total_tokens=None)
    last = _check(*_launch(tmp_path, cfg), bound)
    assert "--max-total-tokens" in last and "no host memory is left for HiCache" in last


def test_ratio_whose_host_pools_cannot_fit_stops_in_the_rank(tmp_path: Path) -> None:
    """4096 device tokens x 256 B (the tiny model's KV) x 100000 = 105 GB of host KV
    pool: more than this machine has. The rank names the flag and a ratio that fits
    before allocating anything; upstream alone refuses later, in the KV host pool,
    without naming the flag (test/integration/test_pinned_total.py: its control)."""
    cfg = ServerConfig(storage_dir=str(tmp_path / "store"), extra_args=["--hicache-ratio", "100000"])
    code, out, _ = Server(cfg, tmp_path / "server.log").run_to_exit(timeout=600)
    assert code != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "sglang-l3: error: --hicache-ratio 100000:" in line]
    assert lines, out[-3000:]
    assert "the HiCache host pools of the 1 rank(s) on this host take" in lines[0], lines[0]
    assert "Fix: --hicache-ratio " in lines[0], lines[0]
    assert "Allocating kv hierarchical KV host pool" not in out  # stopped before any host pool
