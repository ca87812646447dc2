"""Patch `session-hints`: the "speaks next" prefetch route (issue 13, stage 3).

Upstream 0.5.23 has no way for a client to say which context is needed next;
its storage prefetch starts only when the request itself arrives. Two hooks in
the HTTP server process (sglang_l3/sessions/hints.py does the work):

- AFTER `TokenizerManager.__init__`: adds routes to upstream's FastAPI app
  (`sglang.srt.entrypoints.http_server.app`, imported by the launcher before
  it builds the tokenizer manager):
    POST /sglang_l3/prefetch           {"session_id": ..., "input_ids": [...]}
    GET  /sglang_l3/prefetch/{hint_id} staging | landed | failed | deferred_device_full
                                       | not_restorable
    GET  /sglang_l3/sessions           the store's session table + hint counts, each
                                       session's turns seen here, its tokens on the
                                       device (the scheduler's, patch
                                       `session-device-tokens`), the store's bytes
                                       against its cap (read-only; `sglang-l3 top`)
    DELETE /sglang_l3/sessions/{id}    drop a session (every rank's registry)
- AROUND `TokenizerManager.generate_request`: a request that extends an
  in-flight hint's context (or names its session) waits for the hint to land;
  a finished request with a top-level session_id records its context so a hint
  can name just the session, and its turn's timing and prefix source
  (sglang_l3/sessions/activity.py).

A hint is an ordinary prefill-only request, so upstream's own storage prefetch
and load-back stage it, on every TP rank alike.
"""

# No `from __future__ import annotations`: FastAPI reads the route handlers'
# annotations (Request) at runtime, from this module's globals.
import asyncio
import json
import logging
import sys
import time
import weakref
from typing import Any

from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.session_hints")

TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"
HTTP = "sglang.srt.entrypoints.http_server"
ROUTE_MARK = "_sglang_l3_session_routes"
# GET /sglang_l3/sessions waits this long for the scheduler (between two of its steps)
DEVICE_TOKENS_TIMEOUT_S = 5.0


def _tm() -> Any:
    mod = sys.modules.get(HTTP)
    state = getattr(mod, "_global_state", None)
    return getattr(state, "tokenizer_manager", None)


def _store_settings(tm: Any) -> Any:
    from sglang_l3.live_config import value
    from sglang_l3.storage.config import StoreSettings

    # the backend in effect now (PUT /hicache/storage-backend may have attached it)
    if value(tm, "hicache_storage_backend") != "file":
        return None
    raw = value(tm, "hicache_storage_backend_extra_config")
    try:
        extra = json.loads(raw) if isinstance(raw, str) and raw else (raw or {})
        return StoreSettings.resolve(extra)
    except Exception:  # noqa: BLE001 - the store itself reports bad settings at start-up
        return None


def store_root(tm: Any) -> str | None:
    settings = _store_settings(tm)
    return None if settings is None else str(settings.root)


def add_routes(app: Any) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from sglang_l3 import metrics
    from sglang_l3.live_config import value as live_value
    from sglang_l3.sessions.hints import BOOK, HintError

    async def prefetch(request: Request) -> JSONResponse:
        tm = _tm()
        if tm is None:
            return JSONResponse({"error": "server is not ready"}, status_code=503)
        if getattr(tm, "gracefully_exit", False):
            metrics.inc("session_hints", "rejected_draining")
            return JSONResponse({"error": "server is draining; hint refused"}, status_code=503)
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "body is not JSON"}, status_code=400)
        try:
            ids, sid = BOOK.validate(body, int(tm.model_config.vocab_size), getattr(tm, "context_len", None))
        except HintError as e:
            metrics.inc("session_hints", f"rejected_{e.status}")
            return JSONResponse({"error": str(e)}, status_code=e.status)
        hint, created = BOOK.start(tm, ids, sid)
        return JSONResponse(
            {**hint.as_dict(), "joined": not created},
            status_code=202 if created else 200,
        )

    async def prefetch_status(hint_id: str) -> JSONResponse:
        h = BOOK.hints.get(hint_id)
        if h is None:
            return JSONResponse({"error": f"unknown hint {hint_id!r}"}, status_code=404)
        return JSONResponse(h.as_dict())

    async def sessions() -> JSONResponse:
        from sglang_l3.sessions.activity import ACTIVITY
        from sglang_l3.storage.sessions import session_inventory

        tm = _tm()
        device = None if tm is None else await _device_tokens(tm)
        settings = _store_settings(tm) if tm is not None else None
        root = None if settings is None else str(settings.root)
        # one scan of pages/ (seconds for a large store), off the event loop: both agents'
        # streams go through it, and `top` polls this every 2 s
        found, pages_bytes = ([], None) if root is None else await asyncio.to_thread(session_inventory, root)
        rows = [{k: v for k, v in r.items() if k != "keys"} for r in found]
        states: dict[str, int] = {}
        staging: list[str] = []
        for h in BOOK.hints.values():
            states[h.state] = states.get(h.state, 0) + 1
            if h.state == "staging" and h.session_id is not None:
                staging.append(h.session_id)
        return JSONResponse(
            {
                "store": root,
                "sessions": rows,
                "hints": states,
                "remembered_contexts": len(BOOK.contexts),
                # `sglang-l3 top`: per-session turns seen here, hints in flight, the store against its cap
                "activity": ACTIVITY.rows(),
                # the scheduler's: full-KV tokens of each remembered session's context on the device
                "device_tokens": device,
                "staging": sorted(set(staging)),
                "store_bytes": pages_bytes,
                "store_cap_bytes": None if settings is None else int(settings.max_bytes),
                "page_size": live_value(tm, "page_size"),
            }
        )

    async def drop_session(session_id: str) -> JSONResponse:
        from sglang.srt.managers.io_struct import CloseSessionReqInput

        from sglang_l3.patches.sessions.sessions import DROP_MARK
        from sglang_l3.sessions.activity import ACTIVITY
        from sglang_l3.storage.sessions import session_rows, valid_session_id

        tm = _tm()
        if tm is None:
            return JSONResponse({"error": "server is not ready"}, status_code=503)
        root = store_root(tm)
        if root is None:
            return JSONResponse(
                {"error": "this server has no sglang-l3 store (--hicache-storage-backend file)"},
                status_code=409,
            )
        if not valid_session_id(session_id):
            return JSONResponse({"error": f"invalid session id {session_id!r}"}, status_code=400)
        known = session_id in BOOK.contexts or any(
            r.get("id") == session_id for r in await asyncio.to_thread(session_rows, root)
        )
        if not known:
            return JSONResponse({"error": f"unknown session {session_id!r}"}, status_code=404)
        # to every scheduler rank as upstream's close message (patch `sessions` turns it into a drop)
        await tm.close_session(CloseSessionReqInput(session_id=DROP_MARK + session_id))
        BOOK.forget(session_id)
        ACTIVITY.forget(session_id)
        metrics.inc("session_drops")
        return JSONResponse({"dropped": session_id})

    app.add_api_route("/sglang_l3/prefetch", prefetch, methods=["POST"])
    app.add_api_route("/sglang_l3/prefetch/{hint_id}", prefetch_status, methods=["GET"])
    app.add_api_route("/sglang_l3/sessions", sessions, methods=["GET"])
    app.add_api_route("/sglang_l3/sessions/{session_id}", drop_session, methods=["DELETE"])


# tm -> its /get_internal_state call in flight (one at a time; later asks join it)
_INTERNAL_STATE: "weakref.WeakKeyDictionary[Any, asyncio.Task]" = weakref.WeakKeyDictionary()


async def _device_tokens(tm: Any) -> dict[str, int] | None:
    """Per-session device tokens from the scheduler (patch `session-device-tokens`,
    through upstream's internal-state request); None when unknown.

    Upstream's communicator (`FanOutCommunicator.queueing_call`) clears its waiter
    only when the answer is awaited to the end; a waiter cancelled by our timeout
    would stay armed and take the late answer as the next caller's (upstream's
    `/get_server_info` included). So the call runs as its own task that our
    timeout never cancels (asyncio.shield): it ends when the scheduler answers,
    leaving the communicator as it found it; asks meanwhile join it."""
    from sglang_l3.sessions.activity import device_tokens_of

    try:
        task = _INTERNAL_STATE.get(tm)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(tm.get_internal_state())
            task.add_done_callback(_retrieve)
            _INTERNAL_STATE[tm] = task
        states = await asyncio.wait_for(asyncio.shield(task), DEVICE_TOKENS_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - busy or down: the column says unknown
        logger.debug("sglang-l3: no device tokens from the scheduler: %s", e)
        return None
    return device_tokens_of(states)


def _retrieve(task: "asyncio.Task") -> None:
    """A call nobody awaits any more must not log 'exception never retrieved'."""
    if not task.cancelled():
        task.exception()


def _after_init(result: Any, tm: Any, *args: Any, **kwargs: Any) -> None:
    mod = sys.modules.get(HTTP)
    app = getattr(mod, "app", None)
    if app is None or getattr(app.state, ROUTE_MARK, False):
        return
    add_routes(app)
    setattr(app.state, ROUTE_MARK, True)
    return


def _generate_request(original: Any, tm: Any, obj: Any, request: Any = None, *args: Any, **kwargs: Any) -> Any:
    from sglang_l3.sessions.activity import ACTIVITY, context_tokens
    from sglang_l3.sessions.hints import BOOK, prediction, request_ids_and_session

    ids, sid, is_hint = request_ids_and_session(obj)
    top_sid = getattr(obj, "session_id", None)
    # the session whose next turn is predicted (None: a hint, or no session)
    predicted = top_sid if not is_hint and isinstance(top_sid, str) else None

    async def run() -> Any:
        if not is_hint and BOOK.hints:
            await BOOK.join(ids, sid)
        if predicted is not None:
            prediction().arrived(tm, predicted)
        last = None
        # what `sglang-l3 top` shows per session (sglang_l3.sessions.activity)
        watched = None if is_hint or not isinstance(top_sid, str) else top_sid
        t0 = ACTIVITY.started(watched) if watched is not None else 0.0
        first_at: float | None = None
        try:
            async for out in original(tm, obj, request, *args, **kwargs):
                if first_at is None:
                    first_at = time.monotonic()
                last = out
                yield out
        finally:
            if predicted is not None:
                prediction().answered(predicted)
            if watched is not None:
                ACTIVITY.finished(watched, t0, first_at, context_tokens(last), last)
        if ids is not None and isinstance(top_sid, str) and isinstance(last, dict):
            out_ids = last.get("output_ids")
            if isinstance(out_ids, list):
                BOOK.remember(top_sid, ids + out_ids)

    return run()


def apply(ctx: PatchContext) -> None:
    from sglang_l3.sessions.hints import prediction

    prediction()  # a bad SGLANG_L3_PREDICTED_RETURN fails start-up, with its reason
    ctx.after(f"{TM}.__init__", _after_init)
    ctx.around(f"{TM}.generate_request", _generate_request)
