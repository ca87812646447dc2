"""One subpackage per series group (`group` in `series.toml`, repo `patches/`: the index),
one module per upstream change or family of them.

A patch module defines `apply(ctx: PatchContext)` and, optionally,
`applicable() -> str | None` (a reason when the patch does not apply here).
"""

from sglang_l3.patches.framework import (  # noqa: F401
    PatchContext,
    PatchError,
    State,
    apply_all,
    apply_one,
    get_status,
    is_applied,
    load_series,
    status,
    undo,
)
