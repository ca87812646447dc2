"""Why a server process died: the words a failed start-up puts in front of its log.

A launcher that "exited with -9" was SIGKILLed, and three different things do
that on a test machine:
- upstream itself: when a child (scheduler, detokenizer) fails, the launcher's
  SIGQUIT handler calls `kill_process_tree` on its own tree, itself included
  (log lines "Received sigquit from a child process" / "SIGQUIT received" /
  "kill_process_tree called: parent_pid=<launcher>"); the child's error is in the log;
- the kernel's OOM killer (counter `oom_kill` in /proc/vmstat; its "Killed
  process PID (name)" line in the kernel log when that is readable);
- something else: this harness (`Server.stop`) or another process.
`Watch` samples what is needed to tell them apart while the server starts.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess


def oom_kill_count() -> int | None:
    """The kernel's OOM-kill counter (machine-wide), None where unreadable."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def mem_available_mib() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        pass
    return None


def kernel_kill_lines(pids: set[int]) -> list[str] | None:
    """Kernel log lines about OOM-killing one of `pids`; None: the log is not readable."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    hits = []
    for line in out.stdout.splitlines():
        m = re.search(r"(?:Killed process|oom-kill:.*?pid=)\s*(\d+)", line)
        if m and int(m.group(1)) in pids:
            hits.append(line.strip())
    return hits


class Watch:
    """What a starting server's failure message needs: its processes, the OOM-kill
    counter and the lowest available memory seen since `start`."""

    def __init__(self, pid: int):
        self.pid = pid
        self.pids: set[int] = {pid}
        self.oom0 = oom_kill_count()
        self.mem_low = mem_available_mib()
        self.stopped_by_harness = False

    def sample(self) -> None:
        import psutil

        m = mem_available_mib()
        if m is not None and (self.mem_low is None or m < self.mem_low):
            self.mem_low = m
        with contextlib.suppress(psutil.Error):
            self.pids.update(c.pid for c in psutil.Process(self.pid).children(recursive=True))

    def cause(self, code: int, log: str) -> str:
        """A sentence on why the launcher exited with `code`."""
        sig = ""
        if code < 0:
            with contextlib.suppress(ValueError):
                sig = signal.Signals(-code).name
        parts = [f"exit code {code}" + (f" ({sig})" if sig else "")]
        oom = oom_kill_count()
        oom_killed = oom is not None and self.oom0 is not None and oom > self.oom0
        if oom_killed:
            lines = kernel_kill_lines(self.pids)
            which = (
                "; kernel log: " + " | ".join(lines[-3:])
                if lines
                else " (none of this server's processes is named in the kernel log)"
                if lines is not None
                else " (kernel log not readable here)"
            )
            parts.append(f"the kernel's OOM killer killed {oom - (self.oom0 or 0)} process(es) meanwhile{which}")
        elif oom is not None:
            parts.append("no OOM kill on this machine meanwhile (/proc/vmstat oom_kill unchanged)")
        if self.stopped_by_harness:
            parts.append("this harness stopped it (Server.stop)")
        if f"kill_process_tree called: parent_pid={self.pid}," in log or "Received sigquit from a child" in log:
            parts.append(
                "upstream's launcher killed its own process tree after a child process failed "
                "(SIGQUIT handler -> kill_process_tree): the child's error is in the log"
            )
        elif code == -signal.SIGKILL and not self.stopped_by_harness and not oom_killed:
            parts.append("SIGKILL from outside (not upstream's own clean-up, not the OOM killer, not this harness)")
        now = mem_available_mib()
        if now is not None:
            parts.append(f"memory available now {now} MiB, lowest seen during start-up {self.mem_low} MiB")
        return "; ".join(parts)
