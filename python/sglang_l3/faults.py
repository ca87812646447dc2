"""Test faults (`SGLANG_L3_TEST_FAULT`, docs/operations.md): the one small runtime
module a patch asks "is fault NAME active here?", with its parsing, its process state
(spent faults, holds) and when a fault is honoured. It imports nothing of the test
machinery: the simulated device (`sglang_l3.sim.streams`) imports it and reports
itself installed (`simulated_device`), never the other way round.

A fault is honoured only while the CPU switch (`sglang_l3.cpu`: tests, `make demo`)
or the simulated device is active in this process, or the test harness runs its cache
stacks on a GPU (SGLANG_L3_TEST_DEVICE=cuda, test/gpu/device_check.sh, so the fence's
negative control runs on a real device): on a served GPU the variable is
ignored (one warning), so a stray setting can never remove a real fence or hold a real
server's restores. Without the variable every question is answered at once ("no").

Faults (`NAME` or `NAME@ARGUMENT`, several separated by commas):
- skip-load-fence: the streamed restore queues piece copies without the fence on the
  forward stream (the simulated-stream tests must then fail);
- stream-hold@PATH: streamed restores start no read while PATH exists, for at most
  HOLD_S from when it was first seen (`held`);
- read-hold@PATH: a streamed restore's store reads of pieces past the first K (K: the
  integer PATH holds, 0 when it is empty) block in the reader thread while PATH exists,
  for at most HOLD_S from when it was first seen, so a test can abort a request while
  its reads are in flight after K pieces landed (`hold_read`);
- restore-fallback@RANK: that TP rank alone falls back on its first restore, once per
  process (`spend`), to prove SGLANG_L3_VERIFY=1 catches a rank disagreement;
- cut-not-wait: a streamed restore the device cannot take now is cut to what fits
  instead of waiting for rows (the behaviour before it waited), so the server tests of
  what follows a cut (issue 24's hang, its watchdog) can still reach one.
"""

from __future__ import annotations

import logging
import os
import time

from sglang_l3 import envs

logger = logging.getLogger("sglang_l3.faults")

ENV = "SGLANG_L3_TEST_FAULT"
SKIP_LOAD_FENCE = "skip-load-fence"
STREAM_HOLD = "stream-hold"
READ_HOLD = "read-hold"
RESTORE_FALLBACK = "restore-fallback"
CUT_NOT_WAIT = "cut-not-wait"
NAMES = (SKIP_LOAD_FENCE, STREAM_HOLD, READ_HOLD, RESTORE_FALLBACK, CUT_NOT_WAIT)

HOLD_S = 120.0

# process state of the faults (this module only): faults spent, when each hold was first
# seen, whether the simulated device is installed (it says so itself)
_SPENT: set[str] = set()
_HOLD_SINCE: dict[str, float] = {}
_WARNED: list[bool] = [False]
_NOTED: dict[str, object] = {}
_SIMULATED: list[bool] = [False]
_NOTHING = object()


class FaultError(ValueError):
    pass


def _set() -> bool:
    return (envs.value(ENV) or "").strip() not in ("", "unset")


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


def simulated_device(installed: bool) -> None:
    """The simulated device reports itself (`sglang_l3.sim.streams.install/uninstall`):
    while it is installed, faults are honoured."""
    _SIMULATED[0] = installed


def honoured() -> bool:
    """Faults apply here: the CPU switch is on (no accelerator), the simulated device is
    installed, or the tests run their stacks on a GPU (read here, not through
    sglang_l3.testing: the runtime imports no harness)."""
    from sglang_l3 import cpu, envs

    return _SIMULATED[0] or cpu.enabled() or envs.value("SGLANG_L3_TEST_DEVICE").strip().lower() == "cuda"


def active(name: str) -> bool:
    """Fault `name` is set, honoured here, and not spent. An unknown fault name is an
    error where faults are honoured (a mistyped negative control must not pass)."""
    if not _set():
        return False
    if not honoured():
        if not _WARNED[0]:
            _WARNED[0] = True
            logger.warning(
                "sglang-l3: %s ignored: test faults apply only with the CPU switch, the simulated device or "
                "SGLANG_L3_TEST_DEVICE=cuda",
                ENV,
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
    """Block (a reader thread) while an active `read-hold@PATH` holds reads of `piece`
    (0-based, in the stream's order): PATH exists, `piece` is not among the first K it
    lets through (K: the integer in PATH, 0 when empty), and the hold was first seen
    less than HOLD_S ago."""
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
        if changed(f"read-hold {piece}", since):  # once per piece: two readers wait at once
            logger.warning("read-hold: piece %d of a streamed restore waits for %s", piece, path)
        time.sleep(0.02)
