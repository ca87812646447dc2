"""Start, check and stop a loopback Mooncake store for tests and benchmarks.

A Mooncake store is a `mooncake_master` (object metadata, RPC) plus clients
that each contribute a memory *segment*; objects live in those segments. A
SGLang server's embedded client can contribute one, but then its pages die
with it. `MooncakeCluster` therefore starts the master and one storage node
(`mooncake_client`, a standalone client holding `segment_size` bytes), and
servers join with `global_segment_size=0`: their pages land on the storage
node and outlive them ("B restores after A has stopped").

Everything is bound to 127.0.0.1 where Mooncake lets us choose:
- master RPC and its metrics/admin HTTP server: `--rpc_address`, `--metrics_host`;
- the master's embedded HTTP metadata server is disabled (it binds 0.0.0.0
  whatever `--http_metadata_server_host` says); metadata goes peer to peer
  (`P2PHANDSHAKE`) instead;
- the storage node's service port: `--host 127.0.0.1`.
Not choosable in mooncake-transfer-engine-non-cuda 0.3.13.post1: every client's
transfer engine (storage node and each server) opens its P2P handshake
listener on 0.0.0.0 and its TCP data listener on `::` (tcp_transport.cpp:
`TcpContext(port)`; MC_TCP_BIND_ADDRESS only changes the advertised address).
`listeners()` + `transfer_engine_listener()` let tests assert that nothing
*else* is exposed. Processes are started in sessions of their own and stopped
by PID (process group), never by name.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from sglang_l3.testing.server import free_port, stop_process_group

PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
DEBIAN_LIBS = ("libibverbs1", "libnuma1", "libcurl4")
PROTOCOL = "tcp"
METADATA = "P2PHANDSHAKE"


def find_binary(name: str) -> str | None:
    """The wheel installs its binaries next to the interpreter (venv/bin)."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(name)


def unavailable_reason() -> str | None:
    """None when the store can run here, else why not (a test skip reason)."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError for a missing libibverbs/libnuma
        return (
            f"Mooncake is not installed or cannot load ({type(e).__name__}: {e}); "
            f"`make install-mooncake` installs {PACKAGE} and Debian {' '.join(DEBIAN_LIBS)}"
        )
    for b in ("mooncake_master", "mooncake_client"):
        if find_binary(b) is None:
            return f"{b} not found next to {sys.executable} or on PATH ({PACKAGE} installs it)"
    if shutil.which("ss") is None:
        return "`ss` (iproute2) is needed to check what the store listens on"
    return None


# --------------------------------------------------------------------------- #
# Processes
# --------------------------------------------------------------------------- #
class _Proc:
    """One binary in a session of its own, logged to a file, stopped by PID."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.pop("MC_LOG_DIR", None)  # with it the binaries call InitGoogleLogging twice and abort
        env.update(self.env or {})
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        p, self.proc = self.proc, None
        if p is not None:
            stop_process_group(p, timeout)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


class MooncakeError(RuntimeError):
    pass


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pid: int
    process: str

    @property
    def loopback(self) -> bool:
        a = self.address.strip("[]")
        return a.startswith(("127.", "::ffff:127.")) or a == "::1"


_SS_LINE = re.compile(r"^\S+\s+\d+\s+\d+\s+(?P<local>\S+)\s+\S+\s*(?P<users>.*)$")
_SS_USER = re.compile(r'\("(?P<name>[^"]+)",pid=(?P<pid>\d+)')


def listeners(pids: set[int] | None = None) -> list[Listener]:
    """TCP listening sockets (from `ss -ltnpH`), optionally only these PIDs'."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    found: list[Listener] = []
    for line in out.splitlines():
        m = _SS_LINE.match(line.strip())
        if not m:
            continue
        addr, _, port = m.group("local").rpartition(":")
        for u in _SS_USER.finditer(m.group("users")):
            pid = int(u.group("pid"))
            if pids is None or pid in pids:
                found.append(Listener(addr.split("%")[0], int(port), pid, u.group("name")))
    return found


def process_tree(pid: int) -> set[int]:
    """`pid` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (d / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += children.get(p, [])
    return out


def _http_get(url: str, timeout: float = 3.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as f:
        return f.read().decode(errors="replace")


class MooncakeCluster:
    """`mooncake_master` + one storage node on 127.0.0.1; a context manager.

    `extra_config()` is what a SGLang process passes as
    `--hicache-storage-backend-extra-config` to join it.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        segment_size: str = "512MB",
        startup_timeout: float = 60.0,
        storage_node: bool = True,
    ):
        reason = unavailable_reason()
        if reason:
            raise MooncakeError(reason)
        self.workdir = Path(workdir)
        self.segment_size = segment_size
        self.startup_timeout = startup_timeout
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.node_port = free_port()
        self.master = _Proc(self._master_argv(), self.workdir / "mooncake_master.log")
        self.node: _Proc | None = (
            _Proc(self._node_argv(), self.workdir / "mooncake_storage_node.log") if storage_node else None
        )

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def _master_argv(self) -> list[str]:
        return [
            find_binary("mooncake_master") or "mooncake_master",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
        ]

    def _node_argv(self) -> list[str]:
        return [
            find_binary("mooncake_client") or "mooncake_client",
            "--host=127.0.0.1",
            f"--port={self.node_port}",
            f"--master_server_address={self.master_address}",
            f"--metadata_server={METADATA}",
            f"--protocol={PROTOCOL}",
            f"--global_segment_size={self.segment_size}",
        ]

    def extra_config(self, **overrides: Any) -> dict[str, Any]:
        """SGLang's mooncake backend settings for a process joining this store."""
        cfg: dict[str, Any] = {
            "master_server_address": self.master_address,
            "metadata_server": METADATA,
            "protocol": PROTOCOL,
            "local_hostname": "127.0.0.1",
            "master_metrics_port": self.metrics_port,
            # pages go to the storage node so they outlive the server
            "global_segment_size": 0 if self.node is not None else "1gb",
        }
        cfg.update(overrides)
        return cfg

    # ------------------------------------------------------------- lifecycle
    def start(self) -> MooncakeCluster:
        try:
            self.start_master()
            if self.node is not None:
                self.node.start()
                self._wait(
                    lambda: len(self.segments()) >= 1,
                    "the storage node to mount its segment",
                    self.node,
                )
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        self.master.start()
        self._wait(self.master_ready, "mooncake_master to answer", self.master)

    def master_ready(self) -> bool:
        try:
            return '"service_ready":true' in _http_get(f"http://127.0.0.1:{self.metrics_port}/health").replace(" ", "")
        except OSError:
            return False

    def segments(self) -> list[str]:
        try:
            text = _http_get(f"http://127.0.0.1:{self.metrics_port}/get_all_segments")
        except OSError:
            return []
        return [s for s in text.split() if s]

    def _wait(self, cond: Any, what: str, proc: _Proc) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise MooncakeError(f"{proc.argv[0]} exited while waiting for {what}:\n{proc.log_tail()}")
            if cond():
                return
            time.sleep(0.2)
        raise MooncakeError(f"timed out waiting for {what}:\n{proc.log_tail()}")

    def restart_master(self) -> None:
        """Stop the master by PID and start a fresh one on the same ports: every
        object's metadata is gone (clients remount their segments on their own)."""
        self.master.stop()
        self.master = _Proc(self._master_argv(), self.master.log_path)
        self.start_master()

    def stop(self) -> None:
        if self.node is not None:
            self.node.stop()
        self.master.stop()

    def pids(self) -> set[int]:
        return {p for p in (self.master.pid, self.node.pid if self.node else None) if p is not None}

    def master_listeners(self) -> list[Listener]:
        return listeners({self.master.pid} if self.master.pid else set())

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def transfer_engine_listener(lst: Listener) -> bool:
    """A listener that Mooncake's transfer engine opens on all interfaces and
    that no option narrows (see the module docstring)."""
    return lst.process.startswith(("mooncake_client", "python", "sglang")) and lst.address in (
        "0.0.0.0",
        "*",
        "[::]",
        "::",
    )


def client(cluster: MooncakeCluster) -> Any:
    """A plain Mooncake client with no segment (for tests that remove objects)."""
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", METADATA, 0, 16 << 20, PROTOCOL, "", cluster.master_address)
    if rc:
        raise MooncakeError(f"client setup failed: {rc}")
    return s
