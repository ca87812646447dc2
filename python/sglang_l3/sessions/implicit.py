"""Implicit sessions: the server finds an agent's conversation itself (issue 31).

Real agent clients (OpenAI chat completions) send no `session_id`. They keep
their history append-only, so each call's prompt starts with the previous
call's whole input (the next call may diverge just after it: the client
re-serialises the answer) or input + output. Here, in the one process that
sees every request first (the tokenizer manager; patch `implicit-sessions`),
a request without a session id

- continues session S when it extends an *end point* of S's latest turn: the
  exact token prefix of that turn's input up to INPUT_TAIL tokens before its
  end, or its whole input + output, named by its length and a digest of those
  tokens (with the request's extra key and cache salt). The request must extend
  the end point by more than INPUT_TAIL tokens, so an identical prompt (a second
  agent's first call, a retry) is not a continuation. The longest such end
  point wins. (The input's last tokens are the chat template's generation
  prompt, which the next call renders differently: Qwen3.5's `<think>\n` comes
  back as `<think>\n\n</think>`, whose first newline is another token);
- else continues session S when it extends S's *root*, the end point of S's
  first turn's input, and no other session has that root: the client rewrote its
  history but kept how it began. Hermes compacts so: its summary replaces the
  middle, and the system prompt and first message stay (measured with
  hermes-agent 0.19.0). The session table then sees the new turn diverge inside
  the old chain's input and demotes the old tail (storage.retention). Two agents
  whose first calls are the same tokens share a root, and neither continues from
  it: a compaction of either starts a new session;
- otherwise starts a new session with a fresh id (`implicit-<32 hex>`).

End points are token-exact, not page-aligned (issue 49): two agents that send
one long system prompt and first messages of a few tokens differ only inside
the prompt's last page, and a page-aligned end point in that page merged them
into one session. Matching hashes each request once (`prefix_digests`: one pass,
a digest at every end point length in use), whatever the page size.

The id then travels to every TP rank as an explicit top-level `session_id`
does, so retention, the session table and hints by session work unchanged.

Bounded: at most MAX_SESSIONS sessions are tracked, two end points and a root
each (a length and a 16-byte digest); the least recently used one-turn session (a
one-off prompt) is forgotten first. After a restart the end points come back
from the store's session tables (`load`: a record's `ends` and `root`), so a conversation
continues under its id; a table written before end points were recorded
continues none (its sessions keep their retention).
"""

from __future__ import annotations

import hashlib
import uuid
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_l3 import metrics
from sglang_l3.storage.sessions import IMPLICIT_PREFIX, SessionRecord

MAX_SESSIONS = 1024  # as the registry's cap (storage.retention.MAX_IMPLICIT)
# Tokens at an input's end left out of its end point: the generation prompt's tail
# (ChatML's `<|im_end|>\n<|im_start|>assistant\n` is 5 tokens, so the end point never
# reaches back into the user's own words).
INPUT_TAIL = 4


DIGEST_BYTES = 16

# An end point: (tokens, hex digest of those tokens with the request's key namespace).
EndPoint = tuple[int, str]


def end_tokens(n_tokens: int) -> int:
    """Tokens of an n_tokens input up to its end point (see INPUT_TAIL)."""
    return max(0, n_tokens - INPUT_TAIL)


def end_pages(n_tokens: int, page_size: int) -> int:
    """Full pages of an n_tokens input up to its end point (the session table's
    input_pages: what a next turn must keep for its history not to count as rewritten)."""
    return end_tokens(n_tokens) // page_size


def prefix_digests(
    ids: Sequence[int], lengths: Iterable[int], extra_key: Any = None, cache_salt: Any = None
) -> dict[int, str]:
    """{n: digest of ids[:n]} for every n in `lengths` with 0 < n <= len(ids), in one
    pass over the tokens (a digest is read at each length on the way)."""
    want = sorted({n for n in lengths if 0 < n <= len(ids)})
    if not want:
        return {}
    data = memoryview(array("q", ids[: want[-1]]).tobytes())
    h = hashlib.blake2b(repr((extra_key or None, cache_salt or None)).encode(), digest_size=DIGEST_BYTES)
    out: dict[int, str] = {}
    at = 0
    for n in want:
        h.update(data[8 * at : 8 * n])
        at = n
        out[n] = h.hexdigest()
    return out


def end_points(
    ids: Sequence[int], lengths: Iterable[int], extra_key: Any = None, cache_salt: Any = None
) -> list[EndPoint]:
    """The end points of `ids` at `lengths` (shortest first; lengths out of range skipped)."""
    return sorted(prefix_digests(ids, lengths, extra_key, cache_salt).items())


def turn_end_points(
    input_ids: Sequence[int], context: Sequence[int], extra_key: Any, cache_salt: Any
) -> list[EndPoint]:
    """A finished turn's end points: its input up to the tail, and its whole input + output."""
    return end_points(context, (end_tokens(len(input_ids)), len(context)), extra_key, cache_salt)


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
    ends: tuple[EndPoint, ...] = ()  # end points of the latest turn
    turns: int = 0
    root: EndPoint | None = None  # the first turn's input end point


class ImplicitSessions:
    """End point -> session index of the tokenizer manager (one per process)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        # end point -> sessions whose latest turn has it, the earliest to reach it first
        self._by_end: dict[EndPoint, list[str]] = {}
        self._by_root: dict[EndPoint, list[str]] = {}  # root -> sessions (continued from only when one)
        self._lengths: Counter[int] = Counter()  # end point and root lengths in use (what a match hashes)

    def __len__(self) -> int:
        return len(self._sessions)

    def ends(self) -> int:
        return len(self._by_end)

    def match(self, ids: Sequence[int], extra_key: Any = None, cache_salt: Any = None) -> tuple[str, int] | None:
        """(session, tokens) of the longest end point that `ids` extends by more than INPUT_TAIL."""
        return self._match(self._digests(ids, extra_key, cache_salt))

    def match_root(self, ids: Sequence[int], extra_key: Any = None, cache_salt: Any = None) -> tuple[str, int] | None:
        """(session, tokens) of the longest root that `ids` extends by more than
        INPUT_TAIL and that one session alone has."""
        return self._match_root(self._digests(ids, extra_key, cache_salt))

    def _digests(self, ids: Sequence[int], extra_key: Any, cache_salt: Any) -> dict[int, str]:
        limit = len(ids) - INPUT_TAIL
        return prefix_digests(ids, (n for n in self._lengths if n < limit), extra_key, cache_salt)

    def _match(self, digests: dict[int, str]) -> tuple[str, int] | None:
        for n in sorted(digests, reverse=True):
            sids = self._by_end.get((n, digests[n]))
            if sids:
                return sids[0], n
        return None

    def _match_root(self, digests: dict[int, str]) -> tuple[str, int] | None:
        for n in sorted(digests, reverse=True):
            sids = self._by_root.get((n, digests[n]))
            if sids is not None and len(sids) == 1:
                return sids[0], n
        return None

    def decide(self, ids: Sequence[int], extra_key: Any = None, cache_salt: Any = None) -> tuple[str, bool]:
        """(session id, continued) for a request of tokens `ids`; records the request's
        input end point as its session's latest turn (and, for a new session, its root)."""
        digests = self._digests(ids, extra_key, cache_salt)
        hit, how = self._match(digests), "continued"
        if hit is None:
            hit, how = self._match_root(digests), "rewritten"
        if hit is None:
            sid, continued, how = new_id(), False, "started"
        else:
            sid, continued = hit[0], True
        metrics.inc("implicit_sessions", how)
        mine = end_points(ids, (end_tokens(len(ids)),), extra_key, cache_salt)
        s = self._sessions.pop(sid, None) or _Session()
        s.turns += 1
        if s.root is None and mine:
            self._set_root(sid, s, mine[0])
        self._set_ends(sid, s, mine)
        return sid, continued

    def finished(self, sid: str, ends: list[EndPoint]) -> None:
        """A turn of sid finished: its end points become `ends` (`turn_end_points`)."""
        s = self._sessions.get(sid)
        if s is None:
            return  # reaped while it ran
        self._set_ends(sid, s, ends)

    def load(self, records: Iterable[SessionRecord]) -> int:
        """End points of persisted implicit sessions (after a restart), oldest
        first; returns how many sessions were added."""
        n = 0
        for r in sorted(records, key=lambda r: r.last_use):
            if not r.implicit or not r.ends or r.id in self._sessions:
                continue
            s = _Session(turns=r.turns)
            if r.root:
                self._set_root(r.id, s, (int(r.root[0]), str(r.root[1])))
            self._set_ends(r.id, s, [(int(t), str(d)) for t, d in r.ends])
            n += 1
        return n

    def forget(self, sid: str) -> None:
        s = self._sessions.pop(sid, None)
        if s is not None:
            self._drop_ends(sid, s.ends)
            self._drop_root(sid, s)

    def roots(self) -> int:
        return len(self._by_root)

    # ------------------------------------------------------------ internal
    def _set_root(self, sid: str, s: _Session, root: EndPoint) -> None:
        s.root = root
        self._by_root.setdefault(root, []).append(sid)
        self._lengths[root[0]] += 1

    def _drop_root(self, sid: str, s: _Session) -> None:
        if s.root is None:
            return
        sids = self._by_root.get(s.root, [])
        if sid in sids:
            sids.remove(sid)
            if not sids:
                del self._by_root[s.root]
        self._uncount(s.root[0])
        s.root = None

    def _drop_ends(self, sid: str, ends: Iterable[EndPoint]) -> None:
        for k in ends:
            sids = self._by_end.get(k, [])
            if sid in sids:
                sids.remove(sid)
                if not sids:
                    del self._by_end[k]
                self._uncount(k[0])

    def _uncount(self, n: int) -> None:
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]

    def _set_ends(self, sid: str, s: _Session, ends: list[EndPoint]) -> None:
        new = tuple(dict.fromkeys(ends))
        had = set(s.ends)
        self._drop_ends(sid, had.difference(new))
        s.ends = new
        for k in new:
            if k in had:
                continue  # keeps its place among the sessions that reached it
            # Another session may have reached the same end point (two agents whose first
            # calls are the same tokens): each keeps it, and a continuation goes to the
            # earliest, whose own turn then replaces it, so the next goes to the other.
            # Their histories are the same tokens up to it, so neither is merged.
            self._by_end.setdefault(k, []).append(sid)
            self._lengths[k[0]] += 1
        self._sessions[sid] = s
        self._sessions.move_to_end(sid)
        while len(self._sessions) > self.max_sessions:
            victim = next((v for v, x in self._sessions.items() if x.turns < 2), None)
            if victim is None:
                victim = next(iter(self._sessions))
            self.forget(victim)
            metrics.inc("implicit_sessions", "reaped")


__all__ = [
    "INPUT_TAIL",
    "MAX_SESSIONS",
    "EndPoint",
    "ImplicitSessions",
    "end_pages",
    "end_points",
    "end_tokens",
    "new_id",
    "page_keys",
    "prefix_digests",
    "turn_end_points",
]
