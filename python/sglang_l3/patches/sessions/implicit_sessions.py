"""Patch `implicit-sessions`: requests without a session_id get one (issue 31).

Agent clients that speak plain OpenAI chat completions send no session id,
and everything sessions give (L3 retention, the table across restarts,
hints by session) is keyed by one. The decision is made in the tokenizer
manager, the one process that sees every request before the scheduler ranks
(sglang_l3/sessions/implicit.py decides); the id then travels like a
client's top-level `session_id`, so every TP rank records the same session.

- AFTER `TokenizerManager._create_tokenized_object`: a single text request
  (no session_id, no session_params, no images or embeddings, not a hint,
  at least one full page) gets the implicit session whose latest turn's end
  point (a token-exact prefix) it extends, or a new one; the id goes into the
  tokenized request's `session_id`.
- AROUND `TokenizerManager.generate_request`: when such a request finishes,
  its session's end points become its input and input + output, and the
  hint book remembers the context (a hint can name the implicit id). Its
  turn is recorded for `sglang-l3 top` (sglang_l3/sessions/activity.py) as an
  explicit session's is by patch `session-hints`.

Active only with the sglang-l3 file store (where retention and the table
live) and without `--enable-session-radix-cache` (there upstream would open
a radix-native session for every implicit id, which nothing closes).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.implicit_sessions")

TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"
MAX_PENDING = 4096  # requests decided but not yet finished (a bound, not a limit on traffic)
TRACKER_ATTR = "_sglang_l3_implicit_sessions"
CLAIM_WARNED_ATTR = "_sglang_l3_implicit_claim_warned"


class _State:
    def __init__(self, page_size: int):
        from sglang_l3.sessions.implicit import ImplicitSessions

        self.page_size = page_size
        self.tracker = ImplicitSessions()
        # rid -> (session, input tokens, extra key, cache salt)
        self.pending: OrderedDict[str, tuple[str, Any, Any, Any]] = OrderedDict()
        # rid -> session, for `top`: counted speaking from the decision until the
        # request's generator ends (always popped there, so unbounded is safe)
        self.speaking: dict[str, str] = {}


def _state(tm: Any) -> _State | None:
    """The tokenizer manager's implicit-session state; None when inactive."""
    st = getattr(tm, TRACKER_ATTR, None)
    if st is not None:
        return st or None
    from sglang_l3.live_config import value
    from sglang_l3.patches.sessions.session_hints import store_root

    args = getattr(tm, "server_args", None)
    if getattr(args, "enable_session_radix_cache", False):
        setattr(tm, TRACKER_ATTR, False)  # for the server's life
        return None
    root = store_root(tm)
    # the value in effect: without --page-size the launch arguments say None here and the
    # model's resolved default (1 for Qwen3.5) is only in upstream's config bag
    page = int(value(tm, "page_size") or 0)
    if root is None or page <= 0:
        # asked again at the next request: PUT /hicache/storage-backend may attach the
        # store at run time (issue 49: "off" was kept from the first request on)
        return None
    st = _State(page)
    st.tracker.load(_persisted(root))
    setattr(tm, TRACKER_ATTR, st)
    return st


def _persisted(root: str) -> list[Any]:
    """Implicit sessions of the store's tables (a restart continues them)."""
    from sglang_l3.storage import sessions as table
    from sglang_l3.storage.safety import StoreDirs

    out: list[Any] = []
    try:
        with StoreDirs(root, create=False) as dirs:
            for name in table.list_tables(root):
                try:
                    out += [r for r in table.decode(table.read_table_bytes(dirs, name) or b"", None)[1] if r.implicit]
                except (table.TableError, OSError) as e:
                    logger.warning("sglang-l3 implicit sessions: ignoring table %s: %s", name, e)
    except Exception as e:  # noqa: BLE001 - no table: start with none
        logger.warning("sglang-l3 implicit sessions: cannot read the session tables of %s: %s", root, e)
    return out


def _extra_key(tok: Any) -> Any:
    # as the scheduler's Req: the LoRA id is appended to the extra key
    extra, lora = getattr(tok, "extra_key", None), getattr(tok, "lora_id", None)
    return (extra or "") + lora if lora is not None else extra


def _after_tokenize(result: Any, tm: Any, obj: Any, input_text: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput

    from sglang_l3.sessions import pin_book
    from sglang_l3.sessions.activity import ACTIVITY
    from sglang_l3.sessions.contexts import tokens_array
    from sglang_l3.sessions.hints import HINT_RID_PREFIX, prediction
    from sglang_l3.storage.sessions import is_implicit_id

    mm = kwargs.get("mm_inputs", args[1] if len(args) > 1 else None)
    embeds = kwargs.get("input_embeds", args[0] if args else None)
    rid = getattr(result, "rid", None)
    claimed = getattr(obj, "session_id", None)
    if (
        is_implicit_id(claimed)
        and isinstance(result, TokenizedGenerateReqInput)
        and result.session_id == claimed
        and isinstance(rid, str)
        and not rid.startswith(HINT_RID_PREFIX)
    ):
        # The implicit-… ids are the server's (listed by GET /sglang_l3/sessions): a client
        # naming one would record its turn as that agent's, demoting the agent's L3 pages
        # at queue time even if cancelled (issue 49). Treated as no id at all.
        result.session_id = None
        claimed = None
        metrics.inc("implicit_sessions", "claimed_id_ignored")
        if not getattr(tm, CLAIM_WARNED_ATTR, False):
            setattr(tm, CLAIM_WARNED_ATTR, True)  # once: a client may send it on every call
            logger.warning("sglang-l3 implicit sessions: request %s named a server-made session id; ignored", rid)
    if (
        not isinstance(obj, GenerateReqInput)
        or not isinstance(result, TokenizedGenerateReqInput)
        or claimed is not None
        or obj.session_params is not None
        or result.session_id is not None
        or result.session_params is not None
        or input_ids is None
        or mm is not None
        or embeds is not None
        or not isinstance(rid, str)
        or rid.startswith(HINT_RID_PREFIX)
    ):
        return
    st = _state(tm)
    if st is None:
        return
    try:
        ids = [int(t) for t in input_ids]
        extra, salt = _extra_key(result), getattr(result, "cache_salt", None) or None
        if len(ids) < st.page_size:
            return  # under one page: nothing to retain or continue
        sid, _ = st.tracker.decide(ids, extra, salt)
    except Exception:  # bookkeeping must never take a request down
        logger.exception("sglang-l3 implicit sessions: cannot decide the session of %s", rid)
        return
    result.session_id = sid
    st.pending[rid] = (sid, tokens_array(ids), extra, salt)  # 4 bytes a token while it runs
    if rid not in st.speaking:
        ACTIVITY.started(sid)
        st.speaking[rid] = sid
    prediction().arrived(tm, sid)
    pin_book.on_arrival(tm, sid)  # its pin ends before the request reaches the scheduler
    while len(st.pending) > MAX_PENDING:
        st.pending.popitem(last=False)


def _finished(tm: Any, st: _State, rid: str, out_ids: list[int]) -> None:
    from sglang_l3.sessions import turn_pairs
    from sglang_l3.sessions.hints import BOOK
    from sglang_l3.sessions.implicit import turn_end_points

    entry = st.pending.pop(rid, None)
    if entry is None:
        return
    sid, tokens, extra, salt = entry
    ids = tokens.tolist()
    context = ids + out_ids
    st.tracker.finished(sid, turn_end_points(ids, context, extra, salt))
    turn_pairs.on_finished(tm, rid, sid)  # its answer may end in a tool call
    BOOK.remember(sid, context)  # a hint can name the implicit session


def _generate_request(original: Any, tm: Any, obj: Any, request: Any = None, *args: Any, **kwargs: Any) -> Any:
    async def run() -> Any:
        from sglang_l3.sessions import pin_book
        from sglang_l3.sessions.activity import ACTIVITY, context_tokens
        from sglang_l3.sessions.hints import prediction

        st = getattr(tm, TRACKER_ATTR, None)
        out_ids: list[int] = []
        done = False
        t0 = time.monotonic()
        first_at: float | None = None
        last: dict[Any, Any] = {}  # rid -> its last output (a batch interleaves them)
        try:
            async for out in original(tm, obj, request, *args, **kwargs):
                if first_at is None:
                    first_at = time.monotonic()
                if isinstance(out, dict):
                    last[(out.get("meta_info") or {}).get("id")] = out
                if isinstance(out, dict) and isinstance(out.get("output_ids"), list):
                    incremental = getattr(obj, "stream", False) and getattr(tm, "incremental_streaming_output", False)
                    out_ids = out_ids + out["output_ids"] if incremental else list(out["output_ids"])
                    reason = (out.get("meta_info") or {}).get("finish_reason")
                    done = isinstance(reason, dict) and reason.get("type") != "abort"
                yield out
        finally:
            st = st or getattr(tm, TRACKER_ATTR, None)
            rid = getattr(obj, "rid", None)
            if st:
                rids = rid if isinstance(rid, list) else [rid]
                entry = st.pending.get(rid) if isinstance(rid, str) else None
                if entry is not None:
                    prediction().answered(entry[0])
                    pin_book.on_answer(entry[0])
                if done and isinstance(rid, str):
                    try:
                        _finished(tm, st, rid, out_ids)
                    except Exception:  # bookkeeping must never take a request down
                        logger.exception("sglang-l3 implicit sessions: cannot record the turn of %s", rid)
                for r in rids:
                    st.pending.pop(r, None)
                    sid = st.speaking.pop(r, None) if isinstance(r, str) else None
                    if sid is not None:
                        out = last.get(r, last.get(None))
                        ACTIVITY.finished(sid, t0, first_at, context_tokens(out), out)

    return run()


def apply(ctx: PatchContext) -> None:
    ctx.after(f"{TM}._create_tokenized_object", _after_tokenize)
    ctx.around(f"{TM}.generate_request", _generate_request)
