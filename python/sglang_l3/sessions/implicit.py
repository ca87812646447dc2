"""Implicit sessions: the server finds an agent's conversation itself (issue 31).

Real agent clients (OpenAI chat completions) send no `session_id`. They keep
their history append-only, so each call's prompt starts with the previous
call's whole input (the next call may diverge just after it: the client
re-serialises the answer) or input + output. Here, in the one process that
sees every request first (the tokenizer manager; patch `implicit-sessions`),
a request without a session id

- continues session S when one of its page-aligned prefixes is an *end point*
  of S's latest turn: the page key (HiCache's SHA-256 chain, the keys L3
  pages are named with) at the last full page of that turn's input that ends
  at least INPUT_TAIL tokens before the input's end, or at the last full page
  of its input + output. The longest such prefix wins. (The input's last
  tokens are the chat template's generation prompt, which the next call
  renders differently: Qwen3.5's `<think>\n` comes back as
  `<think>\n\n</think>`, whose first newline is another token. With page
  size 1 that last token alone would break every continuation);
- otherwise starts a new session with a fresh id (`implicit-<32 hex>`).

The id then travels to every TP rank as an explicit top-level `session_id`
does, so retention, the session table and hints by session work unchanged.
Two agents that share only a system prompt are two sessions: neither's
prompt contains the other's whole first input. A prefix that is only the
system prompt's pages plus part of a page cannot be told apart; an earlier
input shorter than one page is never an end point.

Bounded: at most MAX_SESSIONS sessions are tracked, two end points each; the
least recently used one-turn session (a one-off prompt) is forgotten first.
After a restart the end points come back from the store's session tables
(`load`), so a conversation continues under its id.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sglang_l3 import metrics
from sglang_l3.storage.sessions import IMPLICIT_PREFIX, SessionRecord

MAX_SESSIONS = 1024  # as the registry's cap (storage.retention.MAX_IMPLICIT)
# Tokens at an input's end left out of its end point: the generation prompt's tail
# (ChatML's `<|im_end|>\n<|im_start|>assistant\n` is 5 tokens, so the end point never
# reaches back into the user's own words).
INPUT_TAIL = 4


def end_pages(n_tokens: int, page_size: int) -> int:
    """Full pages of an n_tokens input up to its end point (see INPUT_TAIL)."""
    return max(0, n_tokens - INPUT_TAIL) // page_size


def new_id() -> str:
    return IMPLICIT_PREFIX + uuid.uuid4().hex


def page_keys(ids: Iterable[int], page_size: int, extra_key: Any = None, cache_salt: Any = None) -> list[str]:
    """HiCache's L3 page-key chain of the full pages of `ids` (the keys the
    scheduler records and names pages with; mem_cache/utils.py)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tokens = list(ids)
    n = (len(tokens) // page_size) * page_size
    if n == 0:
        return []
    keys = get_storage_hash_str(RadixKey(tokens[:n], extra_key, cache_salt=cache_salt), None, page_size=page_size)
    return list(keys) if isinstance(keys, list) else [keys]


@dataclass
class _Session:
    ends: tuple[str, ...] = ()  # end points of the latest turn
    turns: int = 0


class ImplicitSessions:
    """End point -> session index of the tokenizer manager (one per process)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._by_end: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def ends(self) -> int:
        return len(self._by_end)

    def match(self, keys: list[str]) -> tuple[str, int] | None:
        """(session, pages) of the longest end point among keys' prefixes."""
        for i in range(len(keys) - 1, -1, -1):
            sid = self._by_end.get(keys[i])
            if sid is not None:
                return sid, i + 1
        return None

    def decide(self, keys: list[str], end: int | None = None) -> tuple[str, bool]:
        """(session id, continued) for a request with page-key chain `keys`;
        records the request's input end point (page `end`, by default the last)
        as its session's latest turn."""
        hit = self.match(keys)
        if hit is None:
            sid, continued = new_id(), False
            metrics.inc("implicit_sessions", "started")
        else:
            sid, continued = hit[0], True
            metrics.inc("implicit_sessions", "continued")
        s = self._sessions.pop(sid, None) or _Session()
        s.turns += 1
        self._set_ends(sid, s, keys[: len(keys) if end is None else end][-1:])
        return sid, continued

    def finished(self, sid: str, input_keys: int, keys: list[str]) -> None:
        """A turn of sid finished: its end points are its input's (page
        input_keys, `end_pages`) and the last full page of input + output (keys)."""
        s = self._sessions.get(sid)
        if s is None:
            return  # reaped while it ran
        ends = [keys[input_keys - 1]] if 0 < input_keys <= len(keys) else []
        self._set_ends(sid, s, ends + keys[-1:])

    def load(self, records: Iterable[SessionRecord]) -> int:
        """End points of persisted implicit sessions (after a restart), oldest
        first; returns how many sessions were added. The table's input_pages
        are the input's pages up to its end point (patch `sessions`: `end_pages`)."""
        n = 0
        for r in sorted(records, key=lambda r: r.last_use):
            if not r.implicit or not r.keys or r.id in self._sessions:
                continue
            ends = ([r.keys[r.input_pages - 1]] if r.input_pages > 0 else []) + [r.keys[-1]]
            self._set_ends(r.id, _Session(turns=r.turns), ends)
            n += 1
        return n

    def forget(self, sid: str) -> None:
        s = self._sessions.pop(sid, None)
        if s is not None:
            self._drop_ends(sid, s)

    # ------------------------------------------------------------ internal
    def _drop_ends(self, sid: str, s: _Session) -> None:
        for k in s.ends:
            if self._by_end.get(k) == sid:
                del self._by_end[k]

    def _set_ends(self, sid: str, s: _Session, ends: list[str]) -> None:
        self._drop_ends(sid, s)
        s.ends = tuple(dict.fromkeys(ends))
        for k in s.ends:
            other = self._by_end.get(k)
            if other is not None and other != sid:
                # the same context reached again by another session: the latest owns it
                o = self._sessions.get(other)
                if o is not None:
                    o.ends = tuple(e for e in o.ends if e != k)
            self._by_end[k] = sid
        self._sessions[sid] = s
        self._sessions.move_to_end(sid)
        while len(self._sessions) > self.max_sessions:
            victim = next((v for v, x in self._sessions.items() if x.turns < 2), None)
            if victim is None:
                victim = next(iter(self._sessions))
            self.forget(victim)
            metrics.inc("implicit_sessions", "reaped")


__all__ = ["INPUT_TAIL", "MAX_SESSIONS", "ImplicitSessions", "end_pages", "new_id", "page_keys"]
