"""Patch `session-guard`: a hint never evicts an open session's device context (issue 13).

A "speaks next" hint (session_hints.py) is an ordinary prefill-only request.
Admitted into a full device pool, upstream's admission evicts device nodes by
LRU to make room - possibly the context of another *open* session that is
about to speak, which turns a hint into a cold restore for somebody else.

In buffer-only mode the host pool is a staging buffer, not a resting tier:
upstream holds a completed prefetch in host staging only for the request that
issued it (`BufferModePipeline.staged_prefetches`, filled by
`BufferModePipeline.stage_completed_prefetch`, keyed by that request's cache
handle), so a hint cannot leave the
context in host memory for a later request. The guard therefore declines the
hint's device stage instead: AROUND `Scheduler._add_request_to_queue`, when a
hint arrives, it computes whether staging it needs more device rows than are
free plus evictable *without* the device nodes of open sessions' latest
contexts (each such node is locked for the measurement with upstream's
`lock`/`unlock`, so the sizes are the tree core's own). If so, the hint is
answered with an abort whose message carries `deferred_device_full` (the
hint's status says so) and never queued: no L3 read, no allocation, no
eviction. The session's request, when it arrives, is an ordinary request:
it restores from L3 exactly like on a server without hints. A hint sent with
`"evict_open": true` (rid prefix HINT_EVICT_PREFIX) is not guarded: the
client knows that session speaks next and accepts evicting the others.

Same decision on every TP rank: it reads the radix tree, the allocators and
the session registry, which every rank builds from the same requests in the
same order (upstream's PrefillAdder budget relies on the same invariant), and
the verdict is MAX-reduced over the TP CPU group anyway.

The open sessions' contexts are the token ids of each session's last
finished turn, recorded AFTER `UnifiedRadixCache.on_release` (process
memory: after a restart the device is empty, so there is nothing to guard).
"""

from __future__ import annotations

import logging
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext
from sglang_l3.patches.sessions import registry_of, session_id_of
from sglang_l3.session_hints import DEFERRED_DEVICE_FULL, HINT_EVICT_PREFIX, HINT_RID_PREFIX

logger = logging.getLogger("sglang_l3.session_guard")

CACHE = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
SCHED = "sglang.srt.managers.scheduler:Scheduler"
MAX_SESSIONS = 256  # device contexts remembered (most recently finished first; 4 bytes a token)
MAMBA_SLOTS_PER_HINT = 2  # the request's private slot + the node's cached snapshot


@dataclass(frozen=True)
class _Context:
    tokens: array
    extra_key: Any
    cache_salt: Any


_CONTEXTS: weakref.WeakKeyDictionary[Any, OrderedDict[str, _Context]] = weakref.WeakKeyDictionary()


def contexts_of(cache: Any) -> OrderedDict[str, _Context]:
    book = _CONTEXTS.get(cache)
    if book is None:
        book = _CONTEXTS[cache] = OrderedDict()
    return book


def _on_release(result: Any, cache: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    sid = session_id_of(req)
    if sid is None or not req.finished() or isinstance(req.finished_reason, FINISH_ABORT):
        return
    reg = registry_of(cache)
    if reg is None:
        return
    book = contexts_of(cache)
    for gone in [s for s in book if not reg.is_open(s)]:
        del book[gone]  # closed or dropped: nothing to guard
    book[str(sid)] = _Context(
        array("i", list(req.origin_input_ids) + list(req.output_ids)),
        req.extra_key,
        req.cache_salt,
    )
    book.move_to_end(str(sid))
    while len(book) > MAX_SESSIONS:
        book.popitem(last=False)
    return


def _match(cache: Any, tokens: Any, extra_key: Any, cache_salt: Any) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)
    return cache.match_prefix(MatchPrefixParams(key=key))


def _evictable(cache: Any) -> int:
    fn = getattr(cache, "full_evictable_size", None) or cache.evictable_size
    return int(fn())


def verdict(sched: Any, req: Any) -> str | None:
    """None when staging the hint cannot evict an open session's device
    context; else the reason (the hint is declined)."""
    cache = sched.tree_cache
    reg = registry_of(cache)
    book = _CONTEXTS.get(cache)
    if reg is None or not book or getattr(cache, "disable", False):
        return None
    ids = list(req.origin_input_ids)
    page = max(1, int(getattr(sched, "page_size", 1) or 1))
    on_device = int(_match(cache, ids, req.extra_key, req.cache_salt).device_prefix_len)
    need = -(-(len(ids) - on_device) // page) * page
    free = int(sched.token_to_kv_pool_allocator.available_size())
    if need <= free:
        return None  # nothing is evicted at all
    locks, owners = [], []
    try:
        for sid, ctx in book.items():
            if not reg.is_open(sid):
                continue
            m = _match(cache, ctx.tokens, ctx.extra_key, ctx.cache_salt)
            if m.device_prefix_len <= 0 or cache.is_root(m.last_device_node):
                continue
            locks.append(cache.lock(m.last_device_node))
            owners.append(sid)
        if not owners:
            return None
        room = free + _evictable(cache)
        short = need > room
        mamba_alloc = getattr(getattr(sched, "req_to_token_pool", None), "mamba_allocator", None)
        mamba_room = None
        if mamba_alloc is not None and hasattr(cache, "mamba_evictable_size"):
            mamba_room = int(mamba_alloc.available_size()) + int(cache.mamba_evictable_size())
            short = short or mamba_room < MAMBA_SLOTS_PER_HINT
    finally:
        for lock in reversed(locks):
            cache.unlock(lock)
    if not short:
        return None
    return (
        f"sglang-l3 hint {DEFERRED_DEVICE_FULL}: staging {need} tokens on the device would evict "
        f"the device context of open session(s) {sorted(owners)} (free {free}, evictable "
        f"without them {room - free}, mamba slots {mamba_room}); the session's request "
        "restores from L3 when it arrives"
    )


def _any_rank(sched: Any, flag: bool) -> bool:
    """MAX over the TP ranks (every rank reaches this for the same request)."""
    if int(getattr(sched, "tp_size", 1) or 1) <= 1:
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sched.tp_cpu_group)
    return bool(t.item())


def _decline(sched: Any, req: Any, reason: str) -> None:
    from http import HTTPStatus

    from sglang.srt.managers.scheduler import _make_abort_req

    # upstream's own path for a request refused before it is queued
    # (Scheduler._abort_on_queued_limit, then _release_aborted_request)
    sched.send_abort_output(
        _make_abort_req(
            req,
            finished_reason={
                "type": "abort",
                "status_code": HTTPStatus.SERVICE_UNAVAILABLE,
                "message": reason,
            },
        ),
        req,
    )
    sched._release_aborted_request(req)


def _add_request_to_queue(original: Any, sched: Any, req: Any, is_retracted: bool = False) -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    rid = getattr(req, "rid", None)
    if (
        is_retracted
        or not (isinstance(rid, str) and rid.startswith(HINT_RID_PREFIX))
        or rid.startswith(HINT_EVICT_PREFIX)  # the client accepted evicting open sessions
        or req.finished()
        or getattr(req, "to_finish", None) is not None
        or getattr(sched, "disaggregation_mode", DisaggregationMode.NULL) != DisaggregationMode.NULL
    ):
        return original(sched, req, is_retracted)
    try:
        reason = verdict(sched, req)
    except Exception:  # the guard must never take the scheduler down
        logger.exception("sglang-l3 session guard: cannot size hint %s; staging it", rid)
        reason = None
    if _any_rank(sched, reason is not None):
        reason = reason or f"sglang-l3 hint {DEFERRED_DEVICE_FULL} (decided on another TP rank)"
        metrics.inc("session_hint_guard", DEFERRED_DEVICE_FULL)
        logger.info("%s (hint %s)", reason, rid)
        _decline(sched, req, reason)
        return None
    metrics.inc("session_hint_guard", "admitted")
    return original(sched, req, is_retracted)


def apply(ctx: PatchContext) -> None:
    ctx.after(f"{CACHE}.on_release", _on_release)
    ctx.around(f"{SCHED}._add_request_to_queue", _add_request_to_queue)
