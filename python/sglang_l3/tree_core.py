"""Which radix-tree core upstream can run with the torch installed here.

SGLang's Rust tree core (`sglang.srt.mem_cache.rust_tree_core`) is compiled into the
sglang wheel against the torch that wheel pins (0.5.23: torch==2.14.1). Next to
another torch it exchanges tensors with the wrong dtype table: on the borrowed GPU's
torch 2.11 it panicked (`UnknownKind(16)`). The pure-Python core has no such tie.
`rust_core_mismatch()` compares the two versions (the same answer on every TP rank:
it reads package metadata only); `doctor` reports it, and the test harness runs the
Python core where it is not None.
"""

from __future__ import annotations

import importlib.metadata as md

ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"  # upstream's switch (default rust)


def sglang_torch_pin() -> str | None:
    """The exact torch version the installed sglang wheel requires, if it pins one
    (its Requires-Dist, parsed as pip parses it; SGLang itself imports `packaging`)."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        reqs = md.requires("sglang") or []
    except md.PackageNotFoundError:
        return None
    for text in reqs:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name != "torch" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        pins = [s.version for s in req.specifier if s.operator == "=="]
        if len(pins) == 1:
            return pins[0]
    return None


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def rust_core_mismatch() -> str | None:
    """None where the Rust core matches this torch (or nothing says otherwise), else why not."""
    import torch

    pin = sglang_torch_pin()
    have = _release(torch.__version__)
    if pin is None or _release(pin) == have:
        return None
    return f"sglang's Rust tree core is built for torch {pin}; this torch is {torch.__version__}"


def selected_core() -> str:
    """The core upstream selects by default in this environment (its own variable)."""
    from sglang.srt.environ import envs

    return str(envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.get()).strip()
