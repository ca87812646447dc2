"""A launcher fork server for the test suite: `python -m sglang.launch_server`
without paying the launcher's imports at every server start.

A test server's start-up spends about 6 s (quiet machine; 10 s or more on a loaded
2-core one) importing SGLang in the launcher (`sglang.launch_server`, then
`sglang.srt.entrypoints.http_server`) before its own scheduler and detokenizer
processes, which are spawned and import everything again. The suite starts about
60 servers. So each pytest worker starts one *fork server* (`python -m
sglang_l3.testing.forked_launcher`): a fresh interpreter that imports those
upstream modules once (not `sglang.launch_server` itself) and nothing of ours, then forks on request. The forked child
becomes the launcher exactly as `python -m sglang.launch_server ARGS` would run:
its own session (process group), stdin from /dev/null, stdout and stderr to the
server's log, the server's whole environment, then `runpy.run_module(
"sglang.launch_server", run_name="__main__")`. Everything after that is upstream's
and ours as in production: `load_plugins()` (our patches, applied in the child with
the child's environment), argument parsing, and the scheduler and detokenizer
processes, which upstream *spawns* (fresh interpreters that import and patch
themselves, so the plugin's start-up in every process is still what is tested).

What differs from a plain start: the launcher's upstream modules were imported
before its environment was set (SGLang reads its environment variables when they
are used, `sglang.srt.environ`; sglang-l3 is not imported by the fork server), and
every launcher forked by one fork server shares its interpreter state, its string
hash seed included (not its random generators: `fresh_random_state`). A patch
target imported by name before `load_plugins()` would stay unpatched in the importer;
checked (2026-12-07): the preloaded modules hold no such binding.

Used by `sglang_l3.testing.server.Server` for CPU servers when
SGLANG_L3_TEST_FORK_LAUNCHER=1 (unset: off; test/e2e/conftest.py sets it for e2e
tests unless the environment says 0); `run_to_exit` (start-up error tests) always
runs the real command line. Single-threaded on both sides of the fork.

Protocol (one JSON object a line): the client writes {"argv", "env", "cwd", "log"};
the fork server answers {"pid"} (or {"error"}), and {"exit": pid, "code": code}
when a child it forked exits (code < 0: killed by that signal, as Popen says).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

# what `sglang.launch_server` imports, and the HTTP server it starts (not the module
# itself: `python -m` runs it as __main__, and so does the fork)
PRELOAD = (
    "sglang.srt.arg_groups.overrides",
    "sglang.srt.plugins",
    "sglang.srt.server_args",
    "sglang.srt.utils",
    "sglang.srt.utils.common",
    "sglang.srt.entrypoints.http_server",
)
ENV = "SGLANG_L3_TEST_FORK_LAUNCHER"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


# --------------------------------------------------------------------------- #
# The fork server (its own process)
# --------------------------------------------------------------------------- #
def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def fresh_random_state() -> None:
    """In a forked child: NumPy's global generator draws a new seed from the OS, as in
    a fresh interpreter (Python's `random` reseeds itself after a fork; NumPy's does
    not, so every launcher forked by one fork server drew the same NumPy numbers)."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _run_child(req: dict[str, Any], started: int) -> None:
    """In the forked child: become `python -m sglang.launch_server ARGS`. Never returns."""
    os.setsid()
    os.write(started, b"s")  # the process group exists: the client may signal it now
    os.close(started)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)  # the fork server's request and answer pipes are gone from here on
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    fresh_random_state()
    import runpy

    sys.argv = [sys.argv[0], *req["argv"]]
    code: Any = 0
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - reported as `python -m` would, then exit 1
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)  # a normal interpreter exit: atexit handlers run, as in production


def serve() -> None:
    """Import, then fork per request line on stdin until stdin closes."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    children: set[int] = set()
    buf = b""
    open_ = True
    while open_ or children:
        ready, _, _ = select.select([0] if open_ else [], [], [], 0.1)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                open_ = False
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                r, w = os.pipe()
                try:
                    pid = os.fork()
                except OSError as e:
                    os.close(r)
                    os.close(w)
                    out.write(json.dumps({"error": str(e)}).encode() + b"\n")
                    out.flush()
                    continue
                if pid == 0:
                    os.close(r)
                    _run_child(req, w)
                os.close(w)
                os.read(r, 1)  # its session is set up (or it died: EOF)
                os.close(r)
                children.add(pid)
                out.write(json.dumps({"pid": pid}).encode() + b"\n")
                out.flush()
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            with contextlib.suppress(BrokenPipeError):  # the client is gone: nobody asks
                out.write(json.dumps({"exit": pid, "code": _exit_code(status)}).encode() + b"\n")
                out.flush()


# --------------------------------------------------------------------------- #
# The client side (in the test process)
# --------------------------------------------------------------------------- #
class ForkServerError(RuntimeError):
    pass


class _ForkServer:
    """One per test process, started on first use."""

    def __init__(self, python: str):
        env = dict(os.environ)
        env.pop(ENV, None)
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [python, "-m", "sglang_l3.testing.forked_launcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self.lock = threading.Lock()
        self.codes: dict[int, int] = {}
        self._buf = b""
        self._answers: list[dict[str, Any]] = []
        first = self._next_answer(timeout=600.0)
        if not first.get("ready"):
            raise ForkServerError(f"the launcher fork server did not start: {first}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read_lines(self, timeout: float) -> None:
        """Read what the fork server wrote (exit reports are recorded). Lock held."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise ForkServerError(f"the launcher fork server exited ({self.proc.poll()})")
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if "exit" in msg:
                self.codes[msg["exit"]] = msg["code"]
            else:
                self._answers.append(msg)

    def _next_answer(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self._answers:
            if time.monotonic() > deadline:
                raise ForkServerError("the launcher fork server did not answer")
            self._read_lines(0.5)
        return self._answers.pop(0)

    def fork(self, argv: list[str], env: dict[str, str], log: str) -> int:
        req = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": log}
        with self.lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            ans = self._next_answer(timeout=60.0)
        if "pid" not in ans:
            raise ForkServerError(f"the launcher fork server could not fork: {ans}")
        return int(ans["pid"])

    def code(self, pid: int) -> int | None:
        """pid's exit code once it exited, else None (-1: exited, code unknown)."""
        import psutil

        with self.lock:
            if pid not in self.codes:
                with contextlib.suppress(ForkServerError):  # it died: answered below
                    self._read_lines(0.0)
            if pid in self.codes:
                return self.codes[pid]
            if psutil.pid_exists(pid):  # running, or exited and not reaped yet
                return None
            # reaped: the fork server's report follows at once (unless it is gone)
            deadline = time.monotonic() + 5.0
            while pid not in self.codes and self.alive() and time.monotonic() < deadline:
                with contextlib.suppress(ForkServerError):
                    self._read_lines(0.1)
            return self.codes.get(pid, -1)


_SERVERS: dict[str, _ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def _fork_server(python: str) -> _ForkServer:
    with _SERVERS_LOCK:
        fs = _SERVERS.get(python)
        if fs is None or not fs.alive():
            fs = _SERVERS[python] = _ForkServer(python)
        return fs


def shutdown() -> None:
    """Close every fork server of this process (each exits once the launchers it
    forked have exited; a later start makes a new one)."""
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for fs in servers:
        with contextlib.suppress(OSError), fs.lock:
            assert fs.proc.stdin is not None
            fs.proc.stdin.close()


class ForkedLauncher:
    """A launcher forked by the fork server, with the part of `subprocess.Popen`'s
    interface the harness uses: pid, returncode, poll(), wait(timeout)."""

    def __init__(self, python: str, argv: list[str], env: dict[str, str], log: str):
        self._fs = _fork_server(python)
        self.pid = self._fs.fork(argv, env, log)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._fs.code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked launcher {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


if __name__ == "__main__":
    serve()
