"""Native libraries' logs in files, out of the test output.

Mooncake's transfer engine logs through glog. A server's copy writes to the
server's stdout/stderr, which the launcher sends to the server's log file, and
`mooncake_master` / `mooncake_client` log into their own files
(`sglang_l3.testing.mooncake`). A client *inside the test process* (the
integration tests' stores, `mooncake.client()`) writes to fd 2, and its
background threads do so between tests too, where pytest has nothing captured:
`I1130 … transfer_metadata.cpp:616] removeSegmentDesc … finish` between the
progress dots.

Mooncake initialises glog into files when `MC_LOG_DIR` is set as its first
engine starts in a process (`<dir>/mooncake-transfer-engine.<host>.<user>.log.INFO.<date>.<pid>`
and per-severity copies; ERROR and above are also written to stderr, where
pytest captures them with the test that caused them). `route()` sets it for the
test process. It must not reach the Mooncake binaries (with it they call
InitGoogleLogging twice and abort) nor the servers (each keeps its native lines
in its own log file): `child_env()` drops it. glog buffers INFO lines for up
to 30 s; `route()` turns that off in this process (FLAGS_logbuflevel = -1 in the
libglog Mooncake loaded) so a test's lines are in the file when it ends.

`Slices` cuts the lines written during one test into a file of its own, which a
failing test's report names.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from pathlib import Path

ENV = "MC_LOG_DIR"
_routed: Path | None = None


def route(directory: str | os.PathLike) -> Path:
    """Send this process's in-process Mooncake logs to files under `directory`
    (a directory named by the user's own MC_LOG_DIR wins)."""
    global _routed
    if os.environ.get(ENV):
        _routed = Path(os.environ[ENV])
        return _routed
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(d)
    _routed = d
    _unbuffer_glog()
    return d


def _unbuffer_glog() -> None:
    """Load Mooncake's native library now (MC_LOG_DIR is read from then on) and
    make its glog write every line through at once; nothing where it is absent."""
    try:
        import mooncake.store  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or its libraries missing: nothing to route
        return
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "/libglog" in line}
    for path in libs:
        with contextlib.suppress(OSError, ValueError):
            ctypes.c_int.in_dll(ctypes.CDLL(path), "_ZN3fLI17FLAGS_logbuflevelE").value = -1


def routed() -> Path | None:
    return _routed


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` without the test process's log routing (for a child process)."""
    if _routed is not None and env.get(ENV) == str(_routed):
        env = dict(env)
        del env[ENV]
    return env


def _logs(d: Path) -> list[Path]:
    # the full log of each process (INFO has every severity); not the symlinks
    return sorted(p for p in d.glob("*.log.INFO.*") if p.is_file() and not p.is_symlink())


class Slices:
    """Per-test files with what the process's native logs got during the test."""

    def __init__(self, directory: Path):
        self.dir = directory
        self._marks: dict[Path, int] = {}

    def mark(self) -> None:
        """Remember where every log ends now (a test starts)."""
        self._marks = {p: p.stat().st_size for p in _logs(self.dir)}

    def save(self, name: str) -> Path | None:
        """The lines written since `mark()`, in `<dir>/tests/<name>.log` (None: none)."""
        chunks = []
        for p in _logs(self.dir):
            start = self._marks.get(p, 0)
            size = p.stat().st_size
            if size > start:
                with open(p, "rb") as f:
                    f.seek(start)
                    chunks.append(f"==> {p.name} (from byte {start}) <==\n".encode() + f.read(size - start))
        if not chunks:
            return None
        out = self.dir / "tests" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[-150:] + ".log")
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(b"\n".join(chunks))
        return out
