"""Test faults (`SGLANG_L3_TEST_FAULT`, docs/operations.md): the one question a
runtime module asks, "is fault NAME active here?". The machinery (parsing, where a
fault is honoured, once-per-process faults, holds) lives with the simulated device
in `sglang_l3.sim.faults` and is imported only while the variable is set: a served
process without it never loads any of it.

Faults (`NAME` or `NAME@ARGUMENT`, several separated by commas), honoured only with
the CPU switch or the simulated device (never next to an accelerator):
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

from types import ModuleType

from sglang_l3 import envs

ENV = "SGLANG_L3_TEST_FAULT"
SKIP_LOAD_FENCE = "skip-load-fence"
STREAM_HOLD = "stream-hold"
READ_HOLD = "read-hold"
RESTORE_FALLBACK = "restore-fallback"
CUT_NOT_WAIT = "cut-not-wait"
NAMES = (SKIP_LOAD_FENCE, STREAM_HOLD, READ_HOLD, RESTORE_FALLBACK, CUT_NOT_WAIT)


class FaultError(ValueError):
    pass


def _set() -> bool:
    return (envs.value(ENV) or "").strip() not in ("", "unset")


def _machinery() -> ModuleType:
    from sglang_l3.sim import faults

    return faults


def honoured() -> bool:
    """Faults would apply in this process (the CPU switch or the simulated device is on)."""
    return bool(_machinery().honoured())


def active(name: str) -> bool:
    """Fault `name` is set, honoured here and not spent (an unknown name where faults
    are honoured: FaultError)."""
    return _set() and bool(_machinery().active(name))


def argument(name: str) -> str | None:
    """The ARGUMENT of an active `name@ARGUMENT` fault (None: not active or none given)."""
    return _machinery().argument(name) if _set() else None


def spend(name: str) -> None:
    """A once-per-process fault has fired: `active(name)` is False from now on."""
    _machinery().spend(name)


def held(name: str = STREAM_HOLD) -> bool:
    """An active `name@PATH` hold: PATH exists, first seen less than HOLD_S ago."""
    return _set() and bool(_machinery().held(name))


def hold_read(piece: int) -> None:
    """Block (a reader thread) while an active `read-hold@PATH` holds reads of `piece`
    (0-based, in the stream's order)."""
    if _set():
        _machinery().hold_read(piece)


def changed(key: str, value: object) -> bool:
    """True when `value` differs from the last one noted under `key` (log a change once)."""
    return bool(_machinery().changed(key, value))
