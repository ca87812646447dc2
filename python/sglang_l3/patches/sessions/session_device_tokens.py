"""Patch `session-device-tokens`: how many tokens of each session's context the
device holds now, for `sglang-l3 top` (issue 32).

Only the scheduler knows what is on the device (its radix tree); the HTTP
process, where `GET /sglang_l3/sessions` answers, does not. Upstream's
`/get_internal_state` already travels from the tokenizer manager to the
scheduler and back, so AFTER `Scheduler.get_internal_state` the answer gains
`sglang_l3_device_tokens` ({session id: tokens}): for each session whose last
finished context patch `session-guard` remembers (the most recently finished
open sessions, explicit or implicit; session_guard.MAX_SESSIONS), the full-KV
tokens of that context on the device, from upstream's read-only tree walk
(`match_full_device_prefix`: no split, no LRU touch, no lock, so asking never
changes what is evicted). Sessions it does not remember are absent (unknown,
not zero).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_l3.patches.framework import PatchContext
from sglang_l3.patches.sessions.session_guard import contexts_of
from sglang_l3.patches.sessions.sessions import registry_of
from sglang_l3.sessions.activity import DEVICE_TOKENS_KEY

logger = logging.getLogger("sglang_l3.session_device_tokens")

SCHED = "sglang.srt.managers.scheduler:Scheduler"


def device_tokens(cache: Any) -> dict[str, int] | None:
    """{session: full-KV tokens of its last context on the device} for the
    sessions session-guard remembers; None without an sglang-l3 store."""

    if registry_of(cache) is None:
        return None
    core = getattr(cache, "tree_core", None)
    if core is None or getattr(cache, "disable", False):
        return {}
    out: dict[str, int] = {}
    for sid, ctx in list(contexts_of(cache).items()):
        key = ctx.radix_key()
        out[sid] = int(core.match_full_device_prefix(key)[0])
    return out


def _after_get_internal_state(result: Any, sched: Any, *args: Any, **kwargs: Any) -> None:
    state = getattr(result, "internal_state", None)
    if not isinstance(state, dict):
        return
    try:
        tokens = device_tokens(sched.tree_cache)
    except Exception:  # a read-only view must never take the scheduler down
        logger.exception("sglang-l3: cannot count the sessions' device tokens")
        return
    if tokens is not None:
        state[DEVICE_TOKENS_KEY] = tokens


def apply(ctx: PatchContext) -> None:
    ctx.after(f"{SCHED}.get_internal_state", _after_get_internal_state)
