"""Patch `session-guard`: a hint replaces only an idle open session's device context (issue 13).

A "speaks next" hint (sglang_l3.sessions.hints) is an ordinary prefill-only request.
Admitted into a full device pool, upstream's admission evicts device nodes by
LRU to make room. That is what a hint is for when the context it replaces
belongs to an idle open session: that context is safe in L3 (retention keeps
open sessions' pages last) and comes back by the same path when its session
is hinted or speaks. It is wrong when the context is about to be used - so
the guard protects an open session's device context when, at the hint's
arrival, the session

- is busy: a request of it is queued, running or being chunked;
- has its own "speaks next" claim: a hint of it was admitted and no request
  of the session has arrived since (landed but unconsumed, or still staging);
- outranks the hint: its registry priority is higher than the hinted
  session's (a hint with only `input_ids` names no session: it has the lowest
  priority, so it never evicts an open session's context);
- is not yet safe in L3: a node of its device path has a buffer-mode write
  still queued in upstream's pipeline (`BufferModePipeline.pending_write_queue`,
  unpinned until its D2H launch; evicting it drops the write). Launched writes
  are pinned by upstream until their D2H ack and read from host staging after
  it, so they need no protection. The queue changes only at insert and at
  flush, whose staging budget moves with the rank-synced acks
  (`UnifiedRadixCache` MIN-reduces the ack counts over the TP group).

If staging the hint on the device needs more rows (or Mamba slots) than are
free plus evictable with the protected contexts and the hint's own
device prefix locked (upstream's `lock`/`unlock`, so the sizes are the tree
core's own; admission locks that prefix too), the hint is answered
AROUND `Scheduler._add_request_to_queue` with an abort whose message carries
`deferred_device_full` and the protected sessions, and never queued: no L3
read, no allocation, no eviction. The session's request, when it arrives, is
an ordinary request (it restores from L3 like on a server without hints).

Why not "stage to host only": in buffer-only mode (0.5.23) the host pool is a
staging buffer, not a resting tier - upstream holds a completed prefetch in
host staging only for the request that issued it
(`BufferModePipeline.staged_prefetches`, keyed by that request's cache
handle), so a hint cannot park a context in host memory for a later request.

Same decision on every TP rank: the verdict reads the radix tree, the
allocators, the queues and the session registry, which every rank builds from
the same requests in the same order, and is MAX-reduced over the TP CPU group.

A hint stages only what is stored: AROUND `PrefillAdder.add_one_req` (its L3
read staged, as upstream admits it) a hint that would compute more than
HINT_MAX_COMPUTE_TOKENS past its device prefix and host-staged span is not
added, and after the admission pass (AROUND `Scheduler._get_new_batch_prefill_raw`)
it leaves the waiting queue the way upstream's abort takes a queued request,
answered with `not_restorable`. The lengths are the ones upstream's admission
reads (hits MIN-reduced), so every rank drops the same hint.

The open sessions' contexts are the token ids of each session's last finished
turn, recorded AFTER `UnifiedRadixCache.on_release` (process memory: after a
restart the device is empty, so there is nothing to guard).
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
from sglang_l3.patches.sessions.sessions import registry_of, session_id_of
from sglang_l3.sessions.contexts import DEFAULT_MAX_BYTES, tokens_array
from sglang_l3.sessions.hints import DEFERRED_DEVICE_FULL, HINT_RID_PREFIX, NOT_RESTORABLE, hint_session

logger = logging.getLogger("sglang_l3.session_guard")

CACHE = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
SCHED = "sglang.srt.managers.scheduler:Scheduler"
MAX_SESSIONS = 256  # device contexts remembered (most recently finished first)
MAX_CONTEXT_BYTES = DEFAULT_MAX_BYTES  # and their tokens' bytes (4 a token: sessions.contexts)
MAMBA_SLOTS_PER_HINT = 2  # the request's private slot + the node's cached snapshot
# The most a hint may compute at admission past what the device, host staging and L3 hold
# (its tail past the last restorable page); more, and staging it would be a prefill.
HINT_MAX_COMPUTE_TOKENS = 4096
ADDER = "sglang.srt.managers.schedule_policy:PrefillAdder"
_NOT_RESTORABLE = "_sglang_l3_hint_not_restorable"

# why a session's device context is protected (also the counter labels)
BUSY, HINTED, PRIORITY, WRITING = "busy", "hinted", "priority", "writing"


@dataclass(frozen=True)
class _Context:
    tokens: array  # 4 bytes a token (sessions.contexts.tokens_array)
    extra_key: Any
    cache_salt: Any

    def radix_key(self) -> Any:
        """The context as upstream's tree key (its token ids as array('q'))."""
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", self.tokens), self.extra_key, cache_salt=self.cache_salt)


_CONTEXTS: weakref.WeakKeyDictionary[Any, OrderedDict[str, _Context]] = weakref.WeakKeyDictionary()
# per cache: session id -> rid of its admitted hint not yet followed by a request of it
_HINTED: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def contexts_of(cache: Any) -> OrderedDict[str, _Context]:
    book = _CONTEXTS.get(cache)
    if book is None:
        book = _CONTEXTS[cache] = OrderedDict()
    return book


def hinted_of(cache: Any) -> dict[str, str]:
    book = _HINTED.get(cache)
    if book is None:
        book = _HINTED[cache] = {}
    return book


def _on_release(result: Any, cache: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rid = getattr(req, "rid", None)
    aborted = isinstance(getattr(req, "finished_reason", None), FINISH_ABORT)
    if aborted and isinstance(rid, str) and rid.startswith(HINT_RID_PREFIX):
        hinted = _HINTED.get(cache) or {}
        for sid in [s for s, r in hinted.items() if r == rid]:
            del hinted[sid]  # an aborted hint claims nothing
        return
    sid = session_id_of(req)
    if sid is None or not req.finished() or aborted:
        return
    reg = registry_of(cache)
    if reg is None:
        return
    book = contexts_of(cache)
    for gone in [s for s in book if not reg.is_open(s)]:
        del book[gone]  # closed or dropped: nothing to guard
    book.pop(str(sid), None)
    tokens = tokens_array(list(req.origin_input_ids) + list(req.output_ids))
    if tokens.itemsize * len(tokens) <= MAX_CONTEXT_BYTES:
        book[str(sid)] = _Context(tokens, req.extra_key, req.cache_salt)
    held = sum(c.tokens.itemsize * len(c.tokens) for c in book.values())
    while len(book) > MAX_SESSIONS or held > MAX_CONTEXT_BYTES:
        _, old = book.popitem(last=False)
        held -= old.tokens.itemsize * len(old.tokens)
    return


def _match(cache: Any, tokens: Any, extra_key: Any, cache_salt: Any) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)
    return cache.match_prefix(MatchPrefixParams(key=key))


def _evictable(cache: Any) -> int:
    fn = getattr(cache, "full_evictable_size", None) or cache.evictable_size
    return int(fn())


def busy_sessions(sched: Any) -> set[str]:
    """Sessions with a request queued, running or being chunked."""
    reqs: list[Any] = list(getattr(sched, "waiting_queue", ()) or ())
    for name in ("running_batch", "cur_batch", "last_batch"):
        batch = getattr(sched, name, None)
        reqs.extend(getattr(batch, "reqs", None) or ())
    chunked = getattr(sched, "chunked_req", None)
    if chunked is not None:
        reqs.append(chunked)
    out = set()
    for r in reqs:
        sid = session_id_of(r)
        if sid is not None and not r.finished():
            out.add(str(sid))
    return out


def _queued_write_nodes(cache: Any) -> set[Any]:
    """Nodes with a buffer-mode write queued but not launched (unpinned: an
    eviction now drops the write, so the context would not be in L3)."""
    bp = getattr(cache, "buffer_pipeline", None)
    queue = getattr(bp, "pending_write_queue", None)
    return {i.snapshot.node_id for i in queue} if queue else set()


def _protection(cache: Any, reg: Any, sid: str, m: Any, ctx: dict) -> list[str]:
    """Why sid's device context (matched as m) must stay; [] = it may be replaced."""
    why = []
    if sid in ctx["busy"]:
        why.append(BUSY)
    if sid in ctx["hinted"]:
        why.append(HINTED)
    rec = reg.get(sid)
    if ctx["prio"] is None or (rec is not None and rec.priority > ctx["prio"]):
        why.append(PRIORITY)
    if ctx["writes"]:
        path = cache.tree_core.collect_path_info([m.last_device_node])[0]
        if any(p.node_id in ctx["writes"] for p in path):
            why.append(WRITING)
    return why


def verdict(sched: Any, req: Any) -> str | None:
    """None when staging the hint cannot evict a protected open session's
    device context; else the reason (the hint is declined)."""
    cache = sched.tree_cache
    reg = registry_of(cache)
    book = _CONTEXTS.get(cache)
    if reg is None or not book or getattr(cache, "disable", False):
        return None
    ids = list(req.origin_input_ids)
    page = max(1, int(getattr(sched, "page_size", 1) or 1))
    own = _match(cache, ids, req.extra_key, req.cache_salt)
    on_device = int(own.device_prefix_len)
    need = -(-(len(ids) - on_device) // page) * page
    free = int(sched.token_to_kv_pool_allocator.available_size())
    if need <= free:
        return None  # nothing is evicted at all
    hinted = _HINTED.get(cache) or {}
    for gone in [s for s in hinted if not reg.is_open(s)]:
        del hinted[gone]  # closed or dropped: its claim goes too (a reopened session starts clean)
    hinted_sid = hint_session(req.rid)
    hinted_rec = reg.get(hinted_sid) if hinted_sid is not None else None
    ctx = {
        "busy": busy_sessions(sched),
        "hinted": set(hinted),
        "prio": None if hinted_rec is None else hinted_rec.priority,  # None: lowest
        "writes": _queued_write_nodes(cache),
    }
    locks, owners = [], {}
    try:
        if on_device > 0 and not cache.is_root(own.last_device_node):
            # the hint's own device prefix is what admission locks, not room
            locks.append(cache.lock(own.last_device_node))
        for sid, c in book.items():
            if sid == hinted_sid or not reg.is_open(sid):
                continue
            m = _match(cache, c.tokens, c.extra_key, c.cache_salt)
            if m.device_prefix_len <= 0 or cache.is_root(m.last_device_node):
                continue
            why = _protection(cache, reg, sid, m, ctx)
            if not why:
                continue  # idle and safe in L3: the hint may replace it
            locks.append(cache.lock(m.last_device_node))
            owners[sid] = why
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
    for why in owners.values():
        for w in why:
            metrics.inc("session_hint_guard_protected", w)
    named = ", ".join(f"{s} ({'+'.join(w)})" for s, w in sorted(owners.items()))
    return (
        f"sglang-l3 hint {DEFERRED_DEVICE_FULL}: staging {need} tokens on the device would evict "
        f"the device context of protected open session(s) {named} (free {free}, evictable "
        f"without them {room - free}, mamba slots {mamba_room}); the session's request "
        "restores from L3 when it arrives"
    )


def any_rank(sched: Any, flag: bool) -> bool:
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


def _queued(sched: Any, req: Any) -> bool:
    return any(r is req for r in getattr(sched, "waiting_queue", ()))


def _add_request_to_queue(original: Any, sched: Any, req: Any, is_retracted: bool = False) -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    rid = getattr(req, "rid", None)
    is_hint = isinstance(rid, str) and rid.startswith(HINT_RID_PREFIX)
    if (
        is_retracted
        or not is_hint
        or req.finished()
        or getattr(req, "to_finish", None) is not None
        or getattr(sched, "disaggregation_mode", DisaggregationMode.NULL) != DisaggregationMode.NULL
    ):
        result = original(sched, req, is_retracted)
        sid = session_id_of(req)
        if not is_hint and sid is not None:
            hinted = _HINTED.get(sched.tree_cache)
            if hinted:
                hinted.pop(str(sid), None)  # the session's request consumes its hint
        return result
    try:
        reason = verdict(sched, req)
    except Exception:  # the guard must never take the scheduler down
        logger.exception("sglang-l3 session guard: cannot size hint %s; staging it", rid)
        reason = None
    if any_rank(sched, reason is not None):
        reason = reason or f"sglang-l3 hint {DEFERRED_DEVICE_FULL} (decided on another TP rank)"
        metrics.inc("session_hint_guard", DEFERRED_DEVICE_FULL)
        logger.info("%s (hint %s)", reason, rid)
        _decline(sched, req, reason)
        return None
    metrics.inc("session_hint_guard", "admitted")
    result = original(sched, req, is_retracted)
    sid = hint_session(rid)
    if sid is not None and _queued(sched, req):
        assert isinstance(rid, str)  # is_hint: any other rid returned above
        hinted_of(sched.tree_cache)[sid] = rid  # "sid speaks next" until its request arrives
    return result


def _is_hint(req: Any) -> bool:
    rid = getattr(req, "rid", None)
    return isinstance(rid, str) and rid.startswith(HINT_RID_PREFIX)


def hint_compute_tokens(req: Any) -> int:
    """Tokens a hint would compute if admitted now: its input past the device prefix
    and the host-staged span (L3 hits are staged there before admission). Hit lengths
    are MIN-reduced across TP ranks by upstream, the device prefix is the tree's."""
    todo = len(req.full_untruncated_fill_ids) - int(req.prefix_len)  # as upstream's add_one_req
    return max(0, todo - int(getattr(req, "host_hit_length", 0) or 0))


def _add_one_req(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """A hint whose context is not whole on the device, in host staging or in L3 is not
    admitted (its staging would recompute the rest): it is marked, and dropped after the
    admission pass (`_get_new_batch_prefill_raw`)."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    if not _is_hint(req):
        return original(adder, req, *args, **kwargs)
    compute = hint_compute_tokens(req)
    # the same on every rank: upstream's own admission of this request reads the same
    # lengths (device prefix from the tree, hits MIN-reduced), so no reduction is needed
    if compute <= HINT_MAX_COMPUTE_TOKENS:
        return original(adder, req, *args, **kwargs)
    setattr(req, _NOT_RESTORABLE, compute)
    return AddReqResult.OTHER  # not added: upstream reverts its Mamba slot


def _get_new_batch_prefill_raw(original: Any, sched: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(sched, *args, **kwargs)
    for req in [r for r in sched.waiting_queue if getattr(r, _NOT_RESTORABLE, None) is not None]:
        _drop_not_restorable(sched, req)
    return result


def _drop_not_restorable(sched: Any, req: Any) -> None:
    """Upstream's abort of a queued request (`Scheduler.abort_request`, its
    waiting-queue path), with the reason the HTTP side reads."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler import _make_abort_req
    from sglang.srt.mem_cache.common import release_kv_cache

    compute = getattr(req, _NOT_RESTORABLE)
    reason = (
        f"sglang-l3 hint {NOT_RESTORABLE}: {compute} of its {len(req.origin_input_ids)} tokens are not on "
        f"the device, in host staging or in L3; staging it would compute them (at most "
        f"{HINT_MAX_COMPUTE_TOKENS}), so it is dropped"
    )
    metrics.inc("session_hint_guard", NOT_RESTORABLE)
    logger.info("%s (hint %s)", reason, req.rid)
    sched.waiting_queue.remove(req)
    sched._release_aborted_request(req)
    sched.send_abort_output(
        _make_abort_req(
            req,
            finished_reason={"type": "abort", "status_code": HTTPStatus.SERVICE_UNAVAILABLE, "message": reason},
        ),
        req,
    )
    if req.kv.holds_mamba:
        req.finished_reason = FINISH_ABORT()
        release_kv_cache(req, sched.tree_cache, checkpoint=False)


def apply(ctx: PatchContext) -> None:
    ctx.after(f"{CACHE}.on_release", _on_release)
    ctx.around(f"{SCHED}._add_request_to_queue", _add_request_to_queue)
    ctx.around(f"{ADDER}.add_one_req", _add_one_req)
    ctx.around(f"{SCHED}._get_new_batch_prefill_raw", _get_new_batch_prefill_raw)
