""" "Speaks next" hints: stage a session's context before its request arrives.

Runs in the HTTP server process (next to upstream's TokenizerManager). A hint
is an ordinary prefill-only request (`max_new_tokens: 0`) for the context, sent
through `TokenizerManager.generate_request`: the scheduler (every TP rank
alike, requests are broadcast) finds the prefix in L3 and restores it through
upstream's own storage prefetch -> host staging -> device load-back path,
computes the short tail past the last stored page, and leaves the context in
the device tree. A hint never computes more than that tail: one whose context
is not whole on the device, in host staging or in L3 is dropped by the
scheduler at admission (patch session-guard; state not_restorable). The route
returns at once; the hint's state is polled.

A request that extends a hinted context (or names the hinted session) while
the hint is in flight waits for the hint to land and then runs: it reads
nothing twice and never sees a half-staged state (upstream's insert is the
only publication point). A hint cannot change any answer: restores are exact.

Contexts by session: the process remembers, per top-level `session_id`, the
last request's input + output ids, so a hint can name just the session.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sglang_l3 import metrics
from sglang_l3.sessions.contexts import ContextBook
from sglang_l3.sessions.return_prediction import ReturnPredictor, configured_percentile

logger = logging.getLogger(__name__)

HINT_RID_PREFIX = "sglang-l3-hint-"
# State of a hint the scheduler declined because staging it on the device would
# evict an open session's device context (patch session-guard); the marker is
# carried in the abort message.
DEFERRED_DEVICE_FULL = "deferred_device_full"
# State of a hint the scheduler dropped at admission because the device, host and L3
# together hold too little of its context: staging it would be a prefill (patch
# session-guard; the marker is carried in the abort message).
NOT_RESTORABLE = "not_restorable"
# A hint's sampling parameters. It computes no token, but it shares batches with the
# users' requests: sampled parameters (upstream's defaults, or the server's
# `--preferred-sampling-params`, which fill what a request leaves unset) take a whole batch off upstream's
# greedy path (`SamplingBatchInfo.is_all_greedy`, which `filter_batch` never recomputes, so
# every later step of that running batch stays off it), and greedy requests then break
# exact ties by sorting instead of argmax: a hint changed other requests' tokens. Greedy
# and neutral, a hint leaves the batch's sampling as the users' requests make it.
HINT_SAMPLING_PARAMS: dict[str, float | int] = {
    "max_new_tokens": 0,
    "temperature": 0.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
MAX_CONTEXTS = 4096  # sessions whose last context this process remembers
MAX_FINISHED = 4096  # finished hints kept for status queries
JOIN_TIMEOUT_S = 600.0


class HintError(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Hint:
    id: str
    ids: tuple[int, ...]
    session_id: str | None
    state: str = "staging"  # staging | landed | failed | deferred_device_full | not_restorable
    created: float = field(default_factory=time.time)
    finished: float | None = None
    cached: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def as_dict(self) -> dict[str, Any]:
        return {
            "hint_id": self.id,
            "state": self.state,
            "session_id": self.session_id,
            "tokens": len(self.ids),
            "cached": self.cached,
            "error": self.error,
            "seconds": (self.finished or time.time()) - self.created,
        }


class HintBook:
    def __init__(self) -> None:
        # each session's last context (a hint can name the session), bounded in bytes
        self.contexts = ContextBook(MAX_CONTEXTS)
        self.hints: OrderedDict[str, Hint] = OrderedDict()

    # ------------------------------------------------------------ contexts
    def remember(self, sid: str, ids: list[int]) -> None:
        self.contexts.put(sid, ids)

    def forget(self, sid: str) -> None:
        self.contexts.pop(sid)

    # --------------------------------------------------------------- hints
    def inflight(self) -> list[Hint]:
        return [h for h in self.hints.values() if h.state == "staging"]

    def covering(self, ids: list[int] | None, sid: str | None) -> list[Hint]:
        """In-flight hints a request must wait for: same session, or a hinted
        context the request's ids extend."""
        out = []
        for h in self.inflight():
            if (
                sid is not None
                and h.session_id == sid
                or ids is not None
                and len(ids) >= len(h.ids)
                and tuple(ids[: len(h.ids)]) == h.ids
            ):
                out.append(h)
        return out

    async def join(self, ids: list[int] | None, sid: str | None) -> int:
        waited = 0
        for h in self.covering(ids, sid):
            waited += 1
            metrics.inc("session_hints", "joined_by_request")
            try:
                await asyncio.wait_for(h.done.wait(), JOIN_TIMEOUT_S)
            except TimeoutError:
                logger.warning(
                    "sglang-l3 hint %s still staging after %.0f s; request proceeds",
                    h.id,
                    JOIN_TIMEOUT_S,
                )
        return waited

    def validate(self, body: Any, vocab_size: int, context_len: int | None) -> tuple[list[int], str | None]:
        if not isinstance(body, dict):
            raise HintError(400, "body must be a JSON object with session_id and/or input_ids")
        sid, ids = body.get("session_id"), body.get("input_ids")
        if sid is not None and not (isinstance(sid, str) and 0 < len(sid) <= 256):
            raise HintError(400, "session_id must be a non-empty string")
        if ids is None:
            if sid is None:
                raise HintError(400, "give session_id or input_ids")
            known = self.contexts.get(sid)
            if known is None:
                raise HintError(
                    404,
                    f"unknown session {sid!r}: no request of it was served by this "
                    "server; send input_ids with the hint",
                )
            ids = known
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise HintError(400, "input_ids must be a non-empty list of token ids")
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise HintError(400, f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        if context_len is not None and len(ids) >= context_len:
            raise HintError(
                400,
                f"{len(ids)} tokens exceed the model's context length {context_len}",
            )
        return list(ids), sid

    def start(self, tm: Any, ids: list[int], sid: str | None) -> tuple[Hint, bool]:
        """(hint, created): an identical hint in flight is returned, not repeated."""
        key = tuple(ids)
        for h in self.inflight():
            if h.ids == key:
                metrics.inc("session_hints", "joined_by_hint")
                return h, False
        h = Hint(hint_rid(sid), key, sid)
        self.hints[h.id] = h
        while len(self.hints) > MAX_FINISHED:
            oldest = next(iter(self.hints.values()))
            if oldest.state == "staging":
                break
            self.hints.popitem(last=False)
        metrics.inc("session_hints", "started")
        asyncio.get_running_loop().create_task(self._run(tm, h))
        return h, True

    async def _run(self, tm: Any, h: Hint) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(input_ids=list(h.ids), sampling_params=dict(HINT_SAMPLING_PARAMS), rid=h.id)
        try:
            last = None
            async for out in tm.generate_request(obj, None):
                last = out
            meta = (last or {}).get("meta_info", {}) if isinstance(last, dict) else {}
            details = meta.get("cached_tokens_details") or {}
            h.cached = {
                "total": int(meta.get("cached_tokens") or 0),
                **{k: int(details.get(k) or 0) for k in ("device", "host", "storage")},
            }
            reason = (meta.get("finish_reason") or {}) if isinstance(meta.get("finish_reason"), dict) else {}
            if reason.get("type") == "abort":
                raise RuntimeError(reason.get("message") or "aborted")
            h.state = "landed"
            metrics.inc("session_hints", "landed")
            metrics.inc("session_hint_tokens_from_l3", n=h.cached.get("storage", 0))
        except Exception as e:  # noqa: BLE001 - a failed hint is a state, never an error for others
            h.error = str(e) or type(e).__name__
            # declined by the scheduler's guard: not a failure (the device is full, or the
            # context is not in L3 and staging it would compute it)
            h.state = next((m for m in (DEFERRED_DEVICE_FULL, NOT_RESTORABLE) if m in h.error), "failed")
            metrics.inc("session_hints", h.state)
            if h.state == "failed":
                logger.warning("sglang-l3 hint %s failed: %s", h.id, h.error)
        finally:
            h.finished = time.time()
            h.done.set()


BOOK = HintBook()
PREDICT_TICK_S = 0.2


class Prediction:
    """Predicted return (sglang_l3.sessions.return_prediction) driven from the HTTP
    process: requests report arrivals and answers; a background task stages
    due sessions with an ordinary hint of their last context."""

    def __init__(self) -> None:
        pct = configured_percentile()
        self.predictor = None if pct is None else ReturnPredictor(pct)
        self._task: asyncio.Task | None = None

    def arrived(self, tm: Any, sid: str) -> None:
        if self.predictor is None:
            return
        self.predictor.arrived(sid)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(tm))

    def answered(self, sid: str) -> None:
        if self.predictor is not None:
            self.predictor.answered(sid)

    def stage_due(self, tm: Any) -> list[Hint]:
        """Start a hint for every due session whose last context is known."""
        out: list[Hint] = []
        if self.predictor is None:
            return out
        for sid in self.predictor.due():
            ids = BOOK.contexts.get(sid)
            if ids is None or any(h.session_id == sid for h in BOOK.inflight()):
                continue
            hint, _ = BOOK.start(tm, ids, sid)
            metrics.inc("session_hints", "predicted")
            out.append(hint)
        return out

    async def _loop(self, tm: Any) -> None:
        while True:
            await asyncio.sleep(PREDICT_TICK_S)
            try:
                self.stage_due(tm)
            except Exception:  # noqa: BLE001 - prediction must never take serving down
                logger.exception("sglang-l3 predicted return: staging failed")


PREDICTION: Prediction | None = None


def prediction() -> Prediction:
    global PREDICTION
    if PREDICTION is None:
        PREDICTION = Prediction()
    return PREDICTION


def hint_rid(sid: str | None) -> str:
    """A hint's request id. It carries the hinted session (hex, after a "-")
    so the scheduler's guard (patch session-guard) knows whose turn it stages."""
    rid = HINT_RID_PREFIX + uuid.uuid4().hex
    return rid if sid is None else f"{rid}-{sid.encode().hex()}"


def hint_session(rid: Any) -> str | None:
    """The session a hint's request id names; None for a plain input_ids hint
    (or anything that is not a well-formed hint id)."""
    if not (isinstance(rid, str) and rid.startswith(HINT_RID_PREFIX)):
        return None
    _, sep, tail = rid[len(HINT_RID_PREFIX) :].partition("-")
    if not sep or not tail:
        return None
    try:
        return bytes.fromhex(tail).decode()
    except ValueError:
        return None


def request_ids_and_session(obj: Any) -> tuple[list[int] | None, str | None, bool]:
    """(input ids, session id, is_hint) of a GenerateReqInput, for joining."""
    rid = getattr(obj, "rid", None)
    if isinstance(rid, str) and rid.startswith(HINT_RID_PREFIX):
        return None, None, True
    ids = getattr(obj, "input_ids", None)
    if not (isinstance(ids, list) and ids and isinstance(ids[0], int)):
        ids = None
    sid = getattr(obj, "session_id", None)
    params = getattr(obj, "session_params", None)
    if sid is None and params is not None:
        sid = params.get("id") if isinstance(params, dict) else getattr(params, "id", None)
    return ids, sid if isinstance(sid, str) else None, False


__all__ = [
    "BOOK",
    "Prediction",
    "prediction",
    "DEFERRED_DEVICE_FULL",
    "HINT_RID_PREFIX",
    "NOT_RESTORABLE",
    "Hint",
    "HintBook",
    "HintError",
    "hint_rid",
    "hint_session",
    "request_ids_and_session",
]
