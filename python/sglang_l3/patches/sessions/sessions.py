"""Patch `sessions`: upstream's session API drives L3 retention (issue 13).

Upstream (0.5.23) names agents with `/open_session` / `/close_session`,
`session_params.id` and the top-level `session_id`, and with
`--enable-session-radix-cache` protects their device/host entries
(mem_cache/unified_cache/session_ref_tracker.py). The L3 store knows nothing
of sessions: its evictor is plain LRU and the session table lives in process
memory. AFTER hooks feed the store's session registry
(storage/retention.py), on every TP rank alike (same requests, same keys):

- `UnifiedRadixCache.on_release` (after a request's KV went back to the tree,
  both tree cores): a finished, non-aborted request of a session records the
  page-key chain of its context (the same SHA-256 chain HiCache names L3 pages
  with, mem_cache/utils.py:get_storage_hash_str), its token count and priority;
- `Scheduler._add_request_to_queue` (a session's turn is queued, before it
  runs): records the chain of its input, so the pages the running turn
  writes chunk by chunk are protected before it finishes (at release the
  chain grows by the output);
- `Scheduler.open_session`: (re)opens the session in the registry;
- `Scheduler.close_session` and `SessionController._close` (explicit close,
  deferred close, timeout reap): closes it - its pages become evictable before
  any open session's. A close whose id starts with DROP_MARK is a drop through
  the server (AROUND: upstream never sees it): the registry forgets the session.

Apart from the drop message (ours), no hook changes what upstream does; they
read request/tree state only.
Works without `--enable-session-radix-cache`, so on the Rust tree core too
(upstream refuses the session radix cache there).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_l3.patches.framework import PatchContext
from sglang_l3.sessions.implicit import end_pages, turn_end_points
from sglang_l3.storage.sessions import is_implicit_id

logger = logging.getLogger("sglang_l3.sessions")

CACHE = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
SCHED = "sglang.srt.managers.scheduler:Scheduler"
CONTROLLER = "sglang.srt.session.session_controller:SessionController"
# Prefix of the session id of a CloseSessionReqInput that means "drop": not
# printable, so no valid session id (storage.sessions.valid_session_id) has it.
DROP_MARK = "\x00sglang-l3-drop\x00"


def registry_of(cache: Any) -> Any:
    """The session registry of the L3 store behind a tree cache, or None."""
    from sglang_l3.storage.backend import L3FileStore

    ctrl = getattr(cache, "cache_controller", None)
    backend = getattr(ctrl, "storage_backend", None)
    backend = getattr(backend, "_backend", backend)  # test-only failure injector wraps it
    if isinstance(backend, L3FileStore):
        return backend.store.sessions
    return None


def session_id_of(req: Any) -> Any:
    sid = getattr(req, "session_id", None)
    session = getattr(req, "session", None)
    if sid is None and session is not None:
        sid = getattr(session, "session_id", None)
    return sid


def context_keys(cache: Any, req: Any) -> tuple[list[str], int]:
    """(page-key chain, tokens) of a finished request's context, keyed the way
    HiCache keys its L3 pages (namespace seed from extra_key/cache_salt)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tokens = list(req.origin_input_ids) + list(req.output_ids)
    page = int(cache.page_size)
    n = (len(tokens) // page) * page
    if n == 0:
        return [], len(tokens)
    key = RadixKey(tokens[:n], req.extra_key, cache_salt=req.cache_salt)
    keys = get_storage_hash_str(key, None, page_size=page)
    return list(keys) if isinstance(keys, list) else [keys], len(tokens)


def _ends(req: Any) -> list[list[Any]]:
    """A finished turn's end points, as the tokenizer manager records them."""
    inputs = list(req.origin_input_ids)
    context = inputs + list(req.output_ids)
    return [list(e) for e in turn_end_points(inputs, context, req.extra_key, req.cache_salt)]


def _on_release(result: Any, cache: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    sid = session_id_of(req)
    if sid is None or not req.finished() or isinstance(req.finished_reason, FINISH_ABORT):
        return
    reg = registry_of(cache)
    if reg is None:
        return
    try:
        keys, tokens = context_keys(cache, req)
        prio = getattr(req, "priority", None)
        ends = _ends(req) if is_implicit_id(sid) else None
        reg.on_turn(
            str(sid),
            keys,
            tokens,
            priority=int(prio) if prio is not None else None,
            # up to its end point: a next turn that differs only in the input's last
            # tokens (the generation prompt re-rendered) is an ordinary next turn
            input_pages=end_pages(len(req.origin_input_ids), int(cache.page_size)),
            # how the tokenizer manager continues it after a restart (implicit sessions)
            ends=ends,
            # its first turn's input end point (the first recorded stays): how a rewritten
            # history (a compaction that kept the start) continues it after a restart
            root=ends[0] if ends and len(ends) > 1 else None,
        )
    except Exception:  # bookkeeping must never take a request down
        logger.exception("sglang-l3 sessions: cannot record session %s", sid)
    return


def _on_queued(result: Any, sched: Any, req: Any, is_retracted: bool = False) -> None:
    """A session's turn entered the waiting queue: its input's chain becomes the
    session's chain now, so the pages the running turn writes (chunk by chunk)
    are protected before it finishes; on_release then records input + output."""
    sid = session_id_of(req)
    if sid is None or is_retracted or req.finished() or getattr(req, "to_finish", None) is not None:
        return
    if not any(r is req for r in getattr(sched, "waiting_queue", ())):
        return  # refused at the door (queue limit, priority): nothing will run
    reg = registry_of(sched.tree_cache)
    if reg is None:
        return
    try:
        keys, tokens = context_keys(sched.tree_cache, req)
        prio = getattr(req, "priority", None)
        reg.on_turn(
            str(sid),
            keys,
            tokens,
            priority=int(prio) if prio is not None else None,
            finished=False,
        )
    except Exception:  # bookkeeping must never take a request down
        logger.exception("sglang-l3 sessions: cannot protect the running turn of %s", sid)


def _on_open(result: Any, sched: Any, recv_req: Any) -> None:
    sid = recv_req.session_id
    if sid is not None and sid in sched.session_controller:
        reg = registry_of(sched.tree_cache)
        if reg is not None:
            reg.open(str(sid))


def _on_close(result: Any, sched: Any, recv_req: Any) -> None:
    reg = registry_of(sched.tree_cache)
    if reg is not None and recv_req.session_id is not None:
        reg.close(str(recv_req.session_id))


def _close_session(original: Any, sched: Any, recv_req: Any) -> Any:
    """`sglang-l3 sessions --url ... drop ID` (DELETE /sglang_l3/sessions/{id})
    reaches every scheduler rank as upstream's CloseSessionReqInput with
    DROP_MARK before the id (upstream's IPC decodes only its own message types;
    a close is broadcast to every TP rank): the registry forgets the session,
    upstream sees nothing. Any other close is upstream's, then the registry's."""
    sid = recv_req.session_id
    if isinstance(sid, str) and sid.startswith(DROP_MARK):
        reg = registry_of(sched.tree_cache)
        if reg is not None and reg.drop(sid[len(DROP_MARK) :]):
            logger.info("sglang-l3 sessions: dropped session %s", sid[len(DROP_MARK) :])
        return None
    result = original(sched, recv_req)
    _on_close(result, sched, recv_req)
    return result


def _on_controller_close(result: Any, ctrl: Any, session_id: str) -> None:
    reg = registry_of(ctrl.tree_cache)
    if reg is not None:
        reg.close(str(session_id))


def apply(ctx: PatchContext) -> None:
    ctx.after(f"{CACHE}.on_release", _on_release)
    ctx.after(f"{SCHED}._add_request_to_queue", _on_queued)
    ctx.after(f"{SCHED}.open_session", _on_open)
    ctx.around(f"{SCHED}.close_session", _close_session)
    ctx.after(f"{CONTROLLER}._close", _on_controller_close)
