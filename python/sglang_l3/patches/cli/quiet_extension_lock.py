"""Patch `quiet-extension-lock` (why: patches/series.toml): no "Removing stale
PyTorch extension lock" warning in every fresh process.

How: AROUND SGLang's `_extension_build_lock`: upstream still runs unchanged (it
still removes the file, harmlessly), but that one message is logged at DEBUG
instead of WARNING while torch's loader uses FileLock (checked at apply: the
anchor `with FileLock(os.path.join(build_directory, 'lock'))` must be in
torch's `_jit_compile` source, or the patch refuses and the warning stays).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from sglang_l3.patches.framework import PatchContext

_TARGET = "sglang.srt.utils.cpp_extension_loader:_extension_build_lock"
_MESSAGE = "Removing stale PyTorch extension lock"
ANCHOR = "FileLock(os.path.join(build_directory, 'lock'))"


class _Demote(logging.Filter):
    """Re-log upstream's stale-lock warning at DEBUG; pass everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and str(record.msg).startswith(_MESSAGE):
            logging.getLogger(record.name).debug(record.getMessage())
            return False
        return True


class _Quiet:
    """The upstream context manager, with the filter on while it is entered."""

    def __init__(self, cm: Any, logger: logging.Logger):
        self._cm, self._logger = cm, logger

    def __enter__(self) -> Any:
        filt = _Demote()
        self._logger.addFilter(filt)
        try:
            return self._cm.__enter__()
        finally:
            self._logger.removeFilter(filt)

    def __exit__(self, *exc: object) -> Any:
        return self._cm.__exit__(*exc)


def torch_uses_filelock() -> bool:
    from torch.utils import cpp_extension

    try:
        return ANCHOR in inspect.getsource(cpp_extension._jit_compile)
    except (AttributeError, OSError, TypeError):
        return False


def apply(ctx: PatchContext) -> None:
    if not torch_uses_filelock():
        raise RuntimeError(f"anchor not found — torch changed: {ANCHOR!r} not in _jit_compile")
    import sglang.srt.utils.cpp_extension_loader as loader_mod

    logger = loader_mod.logger

    def around(original: Any, *args: Any, **kwargs: Any) -> Any:
        return _Quiet(original(*args, **kwargs), logger)

    ctx.around(_TARGET, around)
