"""The test-fault machinery behind `sglang_l3.faults` (the interface runtime code
asks): parsing SGLANG_L3_TEST_FAULT, when a fault is honoured, once-per-process
faults, holds. Imported only while the variable is set.

A fault is honoured only while the CPU switch (`sglang_l3.cpu`: tests, `make demo`)
or the simulated device (`sglang_l3.sim.streams`) is active in this process:
on a served GPU the variable is ignored (one warning), so a stray setting can never
remove a real fence or hold a real server's restores.
"""

from __future__ import annotations

import logging
import os
import time

from sglang_l3 import envs
from sglang_l3.faults import ENV, NAMES, READ_HOLD, STREAM_HOLD, FaultError

logger = logging.getLogger("sglang_l3.faults")

HOLD_S = 120.0

# process state of the faults (this module only): faults spent, when each hold was first seen
_SPENT: set[str] = set()
_HOLD_SINCE: dict[str, float] = {}
_WARNED: list[bool] = [False]
_NOTED: dict[str, object] = {}
_NOTHING = object()


def _settings() -> dict[str, str | None]:
    """{name: argument} of every fault set (an empty dict: none)."""
    raw = (envs.value(ENV) or "").strip()
    if not raw or raw == "unset":
        return {}
    out: dict[str, str | None] = {}
    for item in (x.strip() for x in raw.split(",")):
        name, sep, arg = item.partition("@")
        if name not in NAMES:
            raise FaultError(f"{ENV}={raw!r}: unknown fault {name!r} (known: {', '.join(NAMES)})")
        out[name] = arg if sep else None
    return out


def honoured() -> bool:
    """Faults apply here: the CPU switch is on (no accelerator) or the simulator is installed."""
    from sglang_l3 import cpu
    from sglang_l3.sim import streams as sim_streams

    return sim_streams.installed() or cpu.enabled()


def active(name: str) -> bool:
    """Fault `name` is set, honoured here, and not spent. An unknown fault name is an
    error where faults are honoured (a mistyped negative control must not pass)."""
    if (envs.value(ENV) or "").strip() in ("", "unset"):
        return False
    if not honoured():
        if not _WARNED[0]:
            _WARNED[0] = True
            logger.warning(
                "sglang-l3: %s ignored: test faults apply only with the CPU switch or the simulated device", ENV
            )
        return False
    return name in _settings() and name not in _SPENT


def argument(name: str) -> str | None:
    """The ARGUMENT of an active `name@ARGUMENT` fault (None: not active or none given)."""
    if not active(name):
        return None
    return _settings().get(name)


def spend(name: str) -> None:
    """A once-per-process fault has fired: `active(name)` is False from now on."""
    _SPENT.add(name)


def changed(key: str, value: object) -> bool:
    """True when `value` differs from the last one noted under `key` (log a change once)."""
    if _NOTED.get(key, _NOTHING) == value:
        return False
    _NOTED[key] = value
    return True


def held(name: str = STREAM_HOLD) -> bool:
    """An active `name@PATH` hold: PATH exists, first seen less than HOLD_S ago."""
    path = argument(name)
    if path is None or not os.path.exists(path):
        _HOLD_SINCE.pop(name, None)
        return False
    since = _HOLD_SINCE.setdefault(name, time.monotonic())
    return time.monotonic() - since < HOLD_S


def hold_read(piece: int) -> None:
    """Wait while `read-hold@PATH` holds reads of `piece`: PATH exists, `piece` is not
    among the first K it lets through (K: the integer in PATH, 0 when empty), and the
    hold was first seen less than HOLD_S ago."""
    path = argument(READ_HOLD)
    if path is None:
        return
    while True:
        try:
            with open(path) as f:
                text = f.read().strip()
        except FileNotFoundError:
            _HOLD_SINCE.pop(READ_HOLD, None)
            return
        if piece < (int(text) if text else 0):
            return
        since = _HOLD_SINCE.setdefault(READ_HOLD, time.monotonic())
        if time.monotonic() - since >= HOLD_S:
            return
        if changed("read-hold", (piece, since)):
            logger.warning("read-hold: piece %d of a streamed restore waits for %s", piece, path)
        time.sleep(0.02)
