"""Helpers for the TP=2 end-to-end tests (test_tp2_*.py): bounded requests and
tests (a hang fails with the server log attached), the L3 page files of one
rank, and the damage the tests do to them.

pytest-timeout is not a dependency: `bounded()` is the same idea (SIGALRM in
the main thread, which interrupts a blocking socket read), and every request
also carries its own socket timeout. Both are reference-machine seconds,
stretched by the machine's measured slowdown (sglang_l3.testing.speed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path

from sglang_l3.testing import speed
from sglang_l3.testing.server import Generation, Server, ServerError

TP = 2
# cpu (default; the cpu-serving patches, gloo) or cuda (>= 2 GPUs: test/gpu/device_check.sh)
DEVICE = os.environ.get("SGLANG_L3_E2E_TP2_DEVICE", "cpu")
# one request at TP=2 on two shared cores takes seconds; a minute of silence is a hang
REQUEST_TIMEOUT = float(os.environ.get("SGLANG_L3_E2E_REQUEST_TIMEOUT", "180"))
TEST_BOUND = float(os.environ.get("SGLANG_L3_E2E_TEST_BOUND", "600"))


class Hang(AssertionError):
    """A request or test did not finish within its bound."""


def logs_of(servers: list[Server], lines: int = 80) -> str:
    out = []
    for s in servers:
        out.append(f"----- {s.log_path} (alive: {s.alive()}) -----\n{s.log_tail(lines)}")
    return "\n".join(out)


@contextlib.contextmanager
def bounded(seconds: float, what: str, servers: Callable[[], list[Server]]) -> Iterator[None]:
    """Fail (never stall) when the block runs longer than `seconds` on the quiet
    reference machine: on a loaded one the bound stretches with the slowdown
    measured while it runs (sglang_l3.testing.speed, checked every 30 s at most)."""
    budget = speed.Budget(seconds)

    def arm() -> None:
        left = max(seconds - budget.spent, 0.0) * budget.factor
        signal.setitimer(signal.ITIMER_REAL, max(0.05, min(30.0, left)))

    def on_alarm(signum: int, frame: object) -> None:
        if budget.expired():
            raise Hang(f"{what}: not finished within {budget.describe()} (hang?)\n{logs_of(servers())}")
        arm()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    arm()
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # an enclosing bound keeps running
            signal.setitimer(signal.ITIMER_REAL, max(0.01, outer - (time.monotonic() - t0)))


def generate(server: Server, ids: list[int], new_tokens: int, what: str, **kw: object) -> Generation:
    """One bounded request; a timeout or a dead server fails with the log."""
    try:
        return server.generate(ids, new_tokens, timeout=REQUEST_TIMEOUT, **kw)  # type: ignore[arg-type]
    except (TimeoutError, urllib.error.URLError, ConnectionError, ServerError) as e:
        raise Hang(f"{what}: request failed: {type(e).__name__}: {e}\n{logs_of([server])}") from e


def flush(server: Server, what: str) -> None:
    try:
        server.flush_cache(timeout=REQUEST_TIMEOUT)
    except (TimeoutError, urllib.error.URLError, ConnectionError, ServerError) as e:
        raise Hang(f"{what}: /flush_cache failed: {type(e).__name__}: {e}\n{logs_of([server])}") from e


def same_output(got: Generation, want: Generation, what: str) -> None:
    assert got.output_ids == want.output_ids, f"{what}: tokens differ: {got.output_ids} vs {want.output_ids}"
    if DEVICE == "cpu":
        # TP=2 with TP=2, torch kernels, fp32 chunk states: bit-exact
        assert not (d := got.logprob_difference(want)), f"{what}: logprobs differ: {d}"
    else:
        # upstream's FLA kernel keeps chunk states in bf16: close, not exact
        diff = max((abs(x - y) for x, y in zip(got.logprobs, want.logprobs, strict=True)), default=0.0)
        assert diff < 0.1, f"{what}: logprobs differ by {diff}"


# --------------------------------------------------------------------------- #
# L3 page files
# --------------------------------------------------------------------------- #
def page_keys(ids: list[int], page_size: int = 64) -> list[str]:
    """The L3 keys of the full pages of `ids` (upstream's SHA-256 chain)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    n = len(ids) // page_size * page_size
    return get_hash_str(ids[:n], None, page_size=page_size)


def page_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "pages").glob("*.bin") if p.is_file())


def page_file(store: Path, key: str, pool: str, rank: int) -> Path | None:
    """The page of `key` in `pool` ("kv" / "mamba") written by TP rank `rank`."""
    hits = [
        p for p in page_files(store) if p.name.startswith(f"{key}.{pool}-") and p.name.endswith(f".r{rank}of{TP}.bin")
    ]
    assert len(hits) <= 1, hits
    return hits[0] if hits else None


def page_name_like(store: Path, key: str, pool: str, rank: int) -> str:
    """The file name `key`'s page would get (suffix learnt from any existing page)."""
    for p in page_files(store):
        if f".{pool}-" in p.name and p.name.endswith(f".r{rank}of{TP}.bin"):
            return key + p.name[p.name.index(f".{pool}-") :]
    raise AssertionError(f"no {pool} page of rank {rank} in {store} to learn the name from")


def quarantined(store: Path) -> list[str]:
    q = store / "quarantine"
    return sorted(p.name for p in q.iterdir()) if q.is_dir() else []


def damage(victim: Path, mode: str) -> None:
    """delete | truncate (to half) | flip (one payload byte, same size) | foreign
    (the other rank's page of the same key: a valid file of another shard)."""
    size = victim.stat().st_size
    if mode == "delete":
        victim.unlink()
    elif mode == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(size // 2)
    elif mode == "flip":
        with open(victim, "r+b") as f:
            f.seek(size - 100)  # in the payload, not the header
            b = f.read(1)
            f.seek(size - 100)
            f.write(bytes([b[0] ^ 0xFF]))
    elif mode == "foreign":
        other = victim.with_name(
            victim.name.replace(f".r1of{TP}.", ".rX.")
            .replace(f".r0of{TP}.", f".r1of{TP}.")
            .replace(".rX.", f".r0of{TP}.")
        )
        tmp = victim.with_suffix(".foreign")
        shutil.copyfile(other, tmp)
        os.replace(tmp, victim)
    else:
        raise ValueError(mode)


def wait_for(cond: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll `cond` for `seconds` (reference-machine seconds, scaled)."""
    seconds = speed.scaled(seconds)
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds:.0f} s")
        time.sleep(0.5)
