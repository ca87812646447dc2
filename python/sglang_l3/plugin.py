"""SGLang general-plugin entry point (group `sglang.srt.plugins`, name `l3`).

`sglang.srt.plugins.load_plugins()` calls `register()` early in every SGLang
process (launcher, each scheduler/TP rank, detokenizer). Children are spawned,
so each process applies the queue itself, once.
"""

from __future__ import annotations

import logging
import os

from sglang_l3 import envs

logger = logging.getLogger("sglang_l3")
_registered = False


def register() -> None:
    """Apply the whole patch queue. A patch that cannot be verified raises.

    Upstream's load_plugins() catches and logs a plugin's exception and then
    serves unpatched; a half-patched server is worse than none, so a failure is
    reported loudly and, unless SGLANG_L3_STRICT=0, the process exits.
    """
    global _registered
    if _registered:
        return
    _registered = True
    # A process SGLang loads us into publishes its counters for `doctor --stats`
    # (SGLANG_L3_PUBLISH_STATS=0 turns that off; the test session does).
    os.environ.setdefault("SGLANG_L3_PUBLISH_STATS", "1")
    from sglang_l3.patches import framework

    try:
        framework.apply_all(strict=True)
    except framework.PatchError as e:
        msg = f"sglang-l3: {e}"
        logger.error(msg)
        if envs.value("SGLANG_L3_STRICT") != "0":
            raise SystemExit(msg) from e
