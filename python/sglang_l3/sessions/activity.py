"""What the HTTP server process saw of each session's turns, for `sglang-l3 top`.

Runs next to upstream's TokenizerManager: patch `session-hints` wraps
`generate_request` and calls `started` / `finished` for every request with a
top-level `session_id`, patch `implicit-sessions` for every request it names
an implicit session. Per session: requests in flight (the
session is speaking), last use, the last turn's context length, where its
prefix came from (upstream's `cached_tokens_details`: device / host / storage)
and the seconds from the request's arrival to its first output. Read by
GET /sglang_l3/sessions (field `activity`).

Only what the request stream shows: the tokens a session has on the device
*now* are the scheduler's; patch `session-device-tokens` adds them to upstream's
internal state under DEVICE_TOKENS_KEY, which GET /sglang_l3/sessions asks for.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_SESSIONS = 4096
# upstream's /get_internal_state answer: {session id: full-KV tokens on the device}
DEVICE_TOKENS_KEY = "sglang_l3_device_tokens"


def context_tokens(out: Any) -> int:
    """Input + output tokens of a finished request (upstream's meta_info)."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict):
        return 0
    return int(meta.get("prompt_tokens") or 0) + int(meta.get("completion_tokens") or 0)


def device_tokens_of(states: Any) -> dict[str, int] | None:
    """The session device tokens of upstream's internal states (one per DP
    rank; TP ranks hold the same tree): merged, or None when no rank has them."""
    if not isinstance(states, list):
        return None
    out: dict[str, int] | None = None
    for st in states:
        got = st.get(DEVICE_TOKENS_KEY) if isinstance(st, dict) else None
        if isinstance(got, dict):
            out = out if out is not None else {}
            for sid, n in got.items():
                out[str(sid)] = out.get(str(sid), 0) + int(n)
    return out


@dataclass
class Activity:
    in_flight: int = 0
    last_use: float = field(default_factory=time.time)
    turns: int = 0
    tokens: int = 0  # last finished turn: input + output ids
    cached: dict[str, int] = field(default_factory=dict)  # last finished turn's cached_tokens_details
    first_output_s: float | None = None  # last finished turn: arrival -> first output

    def as_dict(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "last_use": self.last_use,
            "turns": self.turns,
            "tokens": self.tokens,
            "cached": dict(self.cached),
            "first_output_s": self.first_output_s,
        }


class ActivityBook:
    def __init__(self) -> None:
        self._rows: OrderedDict[str, Activity] = OrderedDict()
        self._lock = threading.Lock()

    def _row(self, sid: str) -> Activity:
        row = self._rows.get(sid)
        if row is None:
            row = self._rows[sid] = Activity()
        self._rows.move_to_end(sid)
        while len(self._rows) > MAX_SESSIONS:
            self._rows.popitem(last=False)
        return row

    def started(self, sid: str) -> float:
        with self._lock:
            row = self._row(sid)
            row.in_flight += 1
            row.last_use = time.time()
        return time.monotonic()

    def finished(self, sid: str, t0: float, first_at: float | None, tokens: int, out: Any) -> None:
        meta = out.get("meta_info") if isinstance(out, dict) else None
        details = (meta or {}).get("cached_tokens_details") or {}
        with self._lock:
            row = self._row(sid)
            row.in_flight = max(0, row.in_flight - 1)
            row.last_use = time.time()
            if meta is not None:
                row.turns += 1
                row.tokens = tokens
                row.cached = {k: int(details.get(k) or 0) for k in ("device", "host", "storage")}
                row.first_output_s = None if first_at is None else first_at - t0

    def forget(self, sid: str) -> None:
        with self._lock:
            self._rows.pop(sid, None)

    def rows(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {sid: a.as_dict() for sid, a in self._rows.items()}


ACTIVITY = ActivityBook()
