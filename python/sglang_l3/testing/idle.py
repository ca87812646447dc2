"""Watch an idle server: how much CPU it uses, and whether its scheduler sleeps.

With `--sleep-on-idle` (`ServerConfig.sleep_on_idle`, the launcher's default)
upstream's scheduler (`Scheduler.init_idle_sleeper`, TP rank 0 only) waits in
`zmq.Poller.poll(1000)` on its input sockets whenever `Scheduler.is_fully_idle`
holds — no batch, no queued request and, with HiCache, no write-through,
load-back, L3 prefetch or backup in flight and an idle buffer-only pipeline. It
wakes at once when a request (or a control message: flush, hint) arrives, and
otherwise once a second to run the idle checks again. Other TP ranks wait for
rank 0 in the next collective. Without the flag the loop polls its sockets
without blocking: one core busy for as long as the server lives.

`observe()` proves a sleep by behaviour, not by a log line: it samples the
kernel's view of the rank-0 scheduler's main thread (`/proc/PID/task/PID/stat`
state; `wchan`, the kernel function it waits in, where readable) and reads the
server's CPU time (`Server.cpu_seconds`) over the same window. A busy loop is
running or runnable ("R") whatever the machine's load; a sleeping one is in
state "S", waiting in the kernel's poll.

Part of an idle server's CPU is not the server's loop at all: torch's gloo
transport runs one thread per process group (`gloo_tcp_loop`) that wakes from
`epoll_wait` every 10 ms whether or not anything is sent
(gloo/transport/tcp/loop.cc, `Loop::run`). A CPU test server has nine such
groups, ~900 wake-ups a second: about 2% of a core on a quiet machine. Their
share moves with what else the machine runs (0.051 of a core in all in one CI
run, 0.015-0.020 beside two spinning processes). `observe()` reports it apart
(`transport_s`), so a check on the server's own idle cost
(`own_core_fraction`) does not move with the machine's load.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sglang_l3.testing.server import Server, ServerError

# the kernel function a thread blocked in poll()/ppoll() waits in (do_sys_poll ->
# poll_schedule_timeout); other waits (futex: a lock, the GIL) are not the sleeper
POLL_WCHAN = ("poll_schedule_timeout", "do_sys_poll", "do_poll")
# thread names (/proc/.../comm) of torch's gloo transport loops: a 10 ms epoll tick each
TRANSPORT_LOOP_COMMS = ("gloo_tcp_loop",)


@dataclass
class IdleObservation:
    wall_s: float
    cpu_s: float  # user + sys of every server process over the window
    samples: int
    asleep: int  # samples with the rank-0 scheduler's main thread blocked in poll
    states: Counter = field(default_factory=Counter)  # "S:poll_schedule_timeout", "R:0", ...
    transport_s: float = 0.0  # CPU of gloo's transport loop threads (in cpu_s)
    transport_loops: int = 0  # how many such threads the server has

    @property
    def core_fraction(self) -> float:
        return self.cpu_s / self.wall_s

    @property
    def own_core_fraction(self) -> float:
        """The server's idle cost without gloo's 10 ms transport ticks."""
        return max(self.cpu_s - self.transport_s, 0.0) / self.wall_s

    @property
    def transport_core_fraction(self) -> float:
        """What one gloo transport loop costs, on average (0 without any)."""
        return self.transport_s / self.wall_s / max(self.transport_loops, 1)

    @property
    def asleep_fraction(self) -> float:
        return self.asleep / max(self.samples, 1)

    def __str__(self) -> str:
        top = ", ".join(f"{k} x{v}" for k, v in self.states.most_common(4))
        return (
            f"{self.cpu_s:.2f} CPU-s in {self.wall_s:.1f} s = {self.core_fraction:.3f} of a core "
            f"({self.own_core_fraction:.3f} without {self.transport_loops} gloo transport loops' "
            f"{self.transport_s:.2f} CPU-s); scheduler asleep in poll in {self.asleep}/{self.samples} samples ({top})"
        )


def sleeping_scheduler_pid(server: Server) -> int:
    """The process of the scheduler that owns the idle sleeper (TP rank 0)."""
    import psutil

    if server.proc is None:
        raise ServerError("server not started")
    found = []
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            title = (p.cmdline() or [""])[0]
        except psutil.Error:
            continue
        if title.startswith("sglang::scheduler"):
            found.append((title, p.pid))
    # "sglang::scheduler" (TP=1) or "sglang::scheduler_TP0" (rank 0 of TP>1)
    for title, pid in sorted(found):
        if title == "sglang::scheduler" or title.endswith("_TP0"):
            return pid
    raise ServerError(f"no rank-0 scheduler process under {server.proc.pid}: {sorted(found)}")


def thread_state(pid: int, tid: int | None = None) -> tuple[str, str]:
    """(state letter, wchan or "") of one thread (the main thread by default)."""
    task = Path(f"/proc/{pid}/task/{tid or pid}")
    stat = (task / "stat").read_text()
    state = stat[stat.rindex(")") + 2]
    try:
        wchan = (task / "wchan").read_text().strip()
    except OSError:
        wchan = ""
    return state, wchan


def server_threads(server: Server) -> dict[tuple[int, int], tuple[str, float]]:
    """{(pid, tid): (thread name, user + sys CPU seconds)} of every thread of the
    server's processes (the launcher and everything below it)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for p in server.processes():
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p.pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    stat = (task / "stat").read_text()
                    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
                    fields = stat[stat.rindex(")") + 2 :].split()
                    # fields 14 and 15 of stat(5) (utime, stime), counted from the state (3)
                    out[(p.pid, int(task.name))] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def transport_cpu(before: dict, after: dict) -> tuple[float, int]:
    """(CPU seconds, count) of the gloo transport loop threads alive at both ends."""
    seconds, loops = 0.0, 0
    for key, (comm, t1) in after.items():
        if comm.startswith(TRANSPORT_LOOP_COMMS) and key in before:
            seconds += t1 - before[key][1]
            loops += 1
    return seconds, loops


def observe(server: Server, seconds: float = 10.0, every: float = 0.2) -> IdleObservation:
    """Watch `server` for `seconds` (send it nothing meanwhile)."""
    pid = sleeping_scheduler_pid(server)
    states: Counter = Counter()
    asleep = samples = 0
    th0, c0, t0 = server_threads(server), server.cpu_seconds(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        state, wchan = thread_state(pid)
        states[f"{state}:{wchan or '?'}"] += 1
        samples += 1
        # wchan "0"/"" (hidden by the kernel): the state alone
        if state == "S" and (wchan in ("", "0") or any(w in wchan for w in POLL_WCHAN)):
            asleep += 1
        time.sleep(every)
    c1, t1, th1 = server.cpu_seconds(), time.monotonic(), server_threads(server)
    transport_s, loops = transport_cpu(th0, th1)
    return IdleObservation(t1 - t0, c1 - c0, samples, asleep, states, transport_s, loops)
