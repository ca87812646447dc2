"""Patch `cli-buffer-only` (why: patches/series.toml): accept `--hicache-mem-layout buffer_only`.

How: AROUND ServerArgs.add_cli_args the choice is added; AROUND from_cli_args and
resolve_once it is translated to

- host memory mode  buffer_only
- layout            page_first_direct (the only layouts the Mamba host pools accept
                    are page_first / page_first_direct)
- io backend        direct on ROCm (hipHostRegister-pinned memory faults with the
                    `kernel` backend, upstream PR #38967); elsewhere too, since
                    `kernel` cannot drive page_first_direct (upstream's HiCache
                    argument hook would switch it anyway).

A contradiction with an explicit `--hicache-host-memory-mode cache`, or with an
explicit `--hicache-io-backend kernel` on ROCm, is a startup error.
"""

from __future__ import annotations

import argparse
from typing import Any

from sglang_l3.patches.framework import PatchContext

CHOICE = "buffer_only"
LAYOUT = "page_first_direct"
HOST_MODE = "buffer_only"
IO_BACKEND = "direct"

_SA = "sglang.srt.server_args:ServerArgs"


class BufferOnlyConflict(SystemExit):
    """Raised (as a clean exit with a message) for a contradictory command line."""

    def __init__(self, message: str):
        super().__init__(f"sglang-l3: error: {message}")
        self.message = message


_EXPLICIT = "_sglang_l3_explicit"


def _record_explicit(action: argparse.Action) -> None:
    """Make `action` note in the namespace that the user gave it a value.

    (argparse re-parses string defaults, so a marker on the default is lost.)
    """
    base = type(action)
    if getattr(base, "_sglang_l3_recording", False):
        return

    # a subclass of whichever argparse.Action class upstream used: mypy cannot check a
    # base known only at run time
    class Recording(base):  # type: ignore[valid-type, misc]
        _sglang_l3_recording = True

        def __call__(self, parser, namespace, values, option_string=None):
            explicit = set(getattr(namespace, _EXPLICIT, ()))
            explicit.add(self.dest)
            setattr(namespace, _EXPLICIT, explicit)
            super().__call__(parser, namespace, values, option_string)

    action.__class__ = Recording


def is_rocm() -> bool:
    from sglang.srt.utils.common import is_hip

    return bool(is_hip())


def _find_action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    for action in parser._actions:
        if flag in action.option_strings:
            return action
    raise RuntimeError(f"upstream parser has no {flag}; re-verify patch cli-buffer-only")


def _extend_parser(parser: argparse.ArgumentParser) -> None:
    layout = _find_action(parser, "--hicache-mem-layout")
    if layout.choices is None:
        raise RuntimeError("upstream --hicache-mem-layout has no choices; re-verify patch cli-buffer-only")
    if CHOICE not in layout.choices:
        layout.choices = [*layout.choices, CHOICE]
    layout.help = (
        f"{layout.help} '{CHOICE}' (sglang-l3) = --hicache-host-memory-mode buffer_only "
        f"with layout {LAYOUT} and io backend {IO_BACKEND}: host RAM is only a staging "
        "buffer between the GPU and the storage backend (L3)."
    )
    for flag in ("--hicache-host-memory-mode", "--hicache-io-backend"):
        _record_explicit(_find_action(parser, flag))


def translate(host_mode: Any, io_backend: Any, *, host_explicit: bool, io_explicit: bool) -> dict[str, str]:
    """The field values `--hicache-mem-layout buffer_only` stands for, or a conflict."""
    if host_explicit and host_mode != HOST_MODE:
        raise BufferOnlyConflict(
            f"--hicache-mem-layout {CHOICE} contradicts --hicache-host-memory-mode "
            f"{host_mode}: '{CHOICE}' selects host memory mode buffer_only. Drop one of them."
        )
    if io_explicit and io_backend != IO_BACKEND and is_rocm():
        raise BufferOnlyConflict(
            f"--hicache-mem-layout {CHOICE} on ROCm needs --hicache-io-backend "
            f"{IO_BACKEND}, got {io_backend}: hipHostRegister-pinned host memory faults "
            "with the kernel io backend (upstream PR #38967)."
        )
    out = {"hicache_host_memory_mode": HOST_MODE, "hicache_mem_layout": LAYOUT}
    if not io_explicit or is_rocm():
        out["hicache_io_backend"] = IO_BACKEND
    return out


def _add_cli_args(original, parser: argparse.ArgumentParser) -> Any:
    result = original(parser)
    _extend_parser(parser)
    return result


def _from_cli_args(original, cls, args: argparse.Namespace) -> Any:
    host = getattr(args, "hicache_host_memory_mode", None)
    io = getattr(args, "hicache_io_backend", None)
    explicit: set[str] = getattr(args, _EXPLICIT, set())
    if getattr(args, "hicache_mem_layout", None) == CHOICE:
        for key, value in translate(
            host,
            io,
            host_explicit="hicache_host_memory_mode" in explicit,
            io_explicit="hicache_io_backend" in explicit,
        ).items():
            setattr(args, key, value)
    return original(cls, args)


def _resolve_once(original, self: Any) -> Any:
    # Programmatic ServerArgs(hicache_mem_layout="buffer_only") reaches resolution
    # untranslated (ServerArgs.__post_init__ is empty in 0.5.23). "cache" is the
    # dataclass default and cannot be told from an explicit one, so only an
    # explicit non-direct io backend on ROCm can conflict here.
    if getattr(self, "hicache_mem_layout", None) == CHOICE:
        for key, value in translate(
            self.hicache_host_memory_mode,
            self.hicache_io_backend,
            host_explicit=False,
            io_explicit=self.hicache_io_backend != "kernel",
        ).items():
            setattr(self, key, value)
    return original(self)


def apply(ctx: PatchContext) -> None:
    ctx.around(f"{_SA}.add_cli_args", _add_cli_args)
    ctx.around(f"{_SA}.from_cli_args", _from_cli_args)
    ctx.around(f"{_SA}.resolve_once", _resolve_once)
