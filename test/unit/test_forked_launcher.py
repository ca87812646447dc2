"""The suite's launcher fork server (sglang_l3.testing.forked_launcher): a forked
child runs `python -m sglang.launch_server ARGS` with the environment, working
directory and log it was given, in a session of its own, and its exit code comes
back as Popen would give it (test/e2e's servers use it; they check the serving)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
from sglang_l3.testing.forked_launcher import ForkedLauncher, shutdown
from sglang_l3.testing.server import ServerConfig, free_port

pytestmark = [pytest.mark.slow]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


def test_a_forked_launcher_is_the_command_line(tmp_path: Path) -> None:
    log = tmp_path / "help.log"
    p = ForkedLauncher(sys.executable, ["--help"], _env(L3_FORK_PROBE="yes"), str(log))
    assert p.wait(600) == 0
    text = log.read_text()
    assert "usage:" in text and "--model-path" in text, text[-2000:]


def test_a_bad_flag_exits_2_and_says_so_in_the_log(tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    p = ForkedLauncher(sys.executable, ["--no-such-flag"], _env(), str(log))
    assert p.wait(600) == 2
    text = log.read_text()
    assert "error:" in text and "Traceback" not in text, text[-2000:]


def test_a_launcher_killed_by_a_signal_reports_it(tmp_path: Path) -> None:
    # a real CPU server's launcher, killed while it starts (it never exits by itself)
    cfg = ServerConfig()
    env = _env(SGLANG_L3_CPU_SERVING="1", **cfg.server_env())
    p = ForkedLauncher(sys.executable, cfg.args(free_port()), env, str(tmp_path / "k.log"))
    try:
        # the fork server answers once the child leads its own session: killpg reaches it alone
        assert os.getpgid(p.pid) == p.pid and os.getsid(p.pid) == p.pid
        os.killpg(p.pid, signal.SIGKILL)
        assert p.wait(600) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        shutdown()


def _draws_of_forked_children(reseed: bool, n: int = 2) -> list[tuple[float, int]]:
    """What `n` children forked from this process draw first from `random` and NumPy."""
    import random

    import numpy as np
    from sglang_l3.testing.forked_launcher import fresh_random_state

    # the parent's generators are in use before the forks
    random.random()
    np.random.randint(1 << 30)
    out = []
    for _ in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: write its draws, exit at once (no pytest teardown)
            try:
                os.close(r)
                if reseed:
                    fresh_random_state()
                os.write(w, f"{random.random()!r} {np.random.randint(1 << 30)}".encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            a, b = f.read().split()
        os.waitpid(pid, 0)
        out.append((float(a), int(b)))
    return out


def test_forked_launchers_draw_their_own_random_numbers() -> None:
    # as two `python -m` starts would (Python's `random` reseeds itself after a fork)
    first, second = _draws_of_forked_children(reseed=True)
    assert first[0] != second[0] and first[1] != second[1]
    # the control: without it, every child of one fork server draws the same NumPy numbers
    first, second = _draws_of_forked_children(reseed=False)
    assert first[0] != second[0] and first[1] == second[1]
