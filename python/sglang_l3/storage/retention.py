"""L3 retention by session: which pages the store evicts last.

Upstream's session API (`/open_session`, `/close_session`, `session_params`,
top-level `session_id`) names the agents; `--enable-session-radix-cache`
protects their device/host entries, but the L3 evictor (upstream's
LRUFileEvictor) is plain LRU. Here every page key on the chain of a session's
latest context is tagged with that session, and the evictor takes victims in
classes:

  0 plain pages (no session)            - LRU order, as upstream
  1 pages of closed sessions            - least recently used session first
  2 pages of open sessions              - lowest priority, then oldest first

Within a session the deepest page goes first, so what stays is still a
restorable prefix. An implicit session (named by the server for requests
without a session_id, sglang_l3.sessions.implicit) ranks as closed until its
second turn or its first turn that ended in a tool call (a one-off prompt is
not protected like a conversation; a tool call is one going on: patch
tool-call-turns), then as an open session of priority 0. Implicit sessions
have no close: the registry keeps at most MAX_IMPLICIT of them and reaps the
oldest one-off session first (then the oldest), by the order of calls, which
is the same on every rank.

Rewritten history: when a session's new turn diverges from its recorded
chain before that chain's input ends (the client compressed or edited its
history, switched model or namespace), the old chain's tail past the shared
prefix is *demoted*: those pages (unless another session holds them) go
before every plain page. The shared prefix stays the session's. The byte cap and the free-space floor both walk this
order to the end: retention decides *what* goes first, never *whether* the
store may shrink - the free-space floor always wins.

The registry is fed identically on every TP rank (same requests, same keys);
only the table writer (rank 0) persists it (`storage/sessions.py`).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sglang_l3 import metrics as l3_metrics
from sglang_l3.storage import sessions as table
from sglang_l3.storage.sessions import SessionRecord, is_implicit_id, valid_session_id

logger = logging.getLogger(__name__)

PLAIN, CLOSED, OPEN, DEMOTED = 0, 1, 2, 3
CLASS_NAMES = ("plain", "closed", "open", "demoted")
MAX_CLOSED = 1024  # closed sessions remembered (oldest forgotten first)
MAX_IMPLICIT = 1024  # implicit sessions remembered (one-turn ones reaped first)
MAX_DEMOTED = 1 << 20  # demoted page keys remembered (oldest forgotten: they become plain)
TABLE_RETRY_S = 30.0  # a table that could not be written is tried again this often


def key_of_stem(stem: str) -> str:
    return stem.split(".", 1)[0]


class SessionRetention:
    """Session -> page-key chain registry (thread-safe) with a persisted table."""

    def __init__(
        self,
        dirs: Any,
        mid: str,
        *,
        writer: bool,
        now: Callable[[], float] = time.time,
    ):
        # dirs: the store's StoreDirs (its descriptor-relative safe file helpers)
        self.dirs, self.mid, self.writer = dirs, mid, writer and dirs is not None
        self._now = now
        self._lock = threading.Lock()
        self._sessions: dict[str, SessionRecord] = {}
        self._by_key: dict[str, dict[str, int]] = {}  # key -> {session id: depth}
        # implicit sessions, least recently used first (the reaping order)
        self._implicit: OrderedDict[str, None] = OrderedDict()
        # page keys of rewritten histories' stale tails, evicted before plain pages
        self._demoted: OrderedDict[str, None] = OrderedDict()
        self._version = 0
        self._saved_version = 0
        self._io_lock = threading.Lock()
        self._table_failing: str | None = None  # why the last table write failed (None: it did not)
        self.table_retry_s = TABLE_RETRY_S
        self._wake = threading.Event()
        self._closed = False
        self.load_reason: str | None = None
        if dirs is not None:
            records, self.load_reason = table.load(dirs, mid)
            for r in sorted(records, key=lambda r: r.last_use):
                self._put(r)
            if records:
                logger.info(
                    "sglang-l3 sessions: %d session(s) restored from %s (%d open)",
                    len(records),
                    dirs.path("models", table.table_name(mid)),
                    sum(r.open for r in records),
                )
        self._thread: threading.Thread | None = None
        if self.writer:
            self._thread = threading.Thread(target=self._writer_loop, name="sglang-l3-sessions", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ registry
    def _put(self, rec: SessionRecord) -> None:
        self._unindex(rec.id)
        self._sessions[rec.id] = rec
        if rec.implicit:
            self._implicit[rec.id] = None
        for depth, k in enumerate(rec.keys):
            self._demoted.pop(k, None)
            self._by_key.setdefault(k, {})[rec.id] = depth

    def _unindex(self, sid: str) -> None:
        old = self._sessions.pop(sid, None)
        self._implicit.pop(sid, None)
        if old is None:
            return
        for k in old.keys:
            owners = self._by_key.get(k)
            if owners is not None:
                owners.pop(sid, None)
                if not owners:
                    del self._by_key[k]

    def _changed(self) -> None:
        self._version += 1
        closed = [r for r in self._sessions.values() if not r.open]
        if len(closed) > MAX_CLOSED:
            for r in sorted(closed, key=lambda r: r.last_use)[: len(closed) - MAX_CLOSED]:
                self._unindex(r.id)
        while len(self._implicit) > MAX_IMPLICIT:
            self._unindex(self._reap_victim())
            l3_metrics.inc("session_implicit_reaped")
        self._wake.set()

    def _reap_victim(self) -> str:
        """The implicit session to forget: the least recently used one-off
        session (a stray prompt), else the least recently used one."""
        for sid in self._implicit:
            if self._sessions[sid].one_off():
                return sid
        return next(iter(self._implicit))

    def on_turn(
        self,
        sid: str,
        keys: list[str],
        tokens: int,
        priority: int | None = None,
        *,
        finished: bool = True,
        input_pages: int | None = None,
        ends: list[list[Any]] | None = None,
        root: list[Any] | None = None,
    ) -> bool:
        """A request of session sid finished (or, finished=False, was queued:
        its input's chain is protected while it runs): keys is the chain,
        input_pages the full pages of the request's input (default: all)."""
        if not valid_session_id(sid):
            return False
        n_in = len(keys) if input_pages is None else max(0, min(int(input_pages), len(keys)))
        with self._lock:
            old = self._sessions.get(sid)
            prio = priority if priority is not None else (old.priority if old else 0)
            # A closed session stays closed (a late finish after /close_session
            # must not re-protect it); /open_session reopens it.
            is_open = old.open if old is not None else True
            # a turn counts when it is queued; a finish never seen queued counts once
            turns = (old.turns if old else 0) + (0 if finished else 1)
            rec = SessionRecord(sid, list(keys), int(tokens), int(prio), self._now(), is_open)
            rec.implicit, rec.turns, rec.input_pages = is_implicit_id(sid), max(turns, 1), n_in
            rec.tool_calls = old.tool_calls if old else 0
            # a queued turn keeps the last finished turn's end points until it finishes
            rec.ends = [list(e) for e in ends] if ends is not None else (list(old.ends) if old else [])
            # the first root recorded stays (the tokenizer manager keeps its first turn's)
            rec.root = list(old.root) if old is not None and old.root else list(root or [])
            stale = [] if old is None else self._stale_tail(old, keys)
            self._put(rec)
            for k in stale:
                if k not in self._by_key:  # no session holds it any more
                    self._demoted[k] = None
            while len(self._demoted) > MAX_DEMOTED:
                self._demoted.popitem(last=False)
            self._changed()
        l3_metrics.inc("session_turns" if finished else "session_turns_started")
        if stale:
            l3_metrics.inc("session_history_rewritten")
        return True

    @staticmethod
    def _stale_tail(old: SessionRecord, keys: list[str]) -> list[str]:
        """The old chain's keys past the prefix it shares with `keys`, when
        the new chain diverges before the old chain's input ended (a
        rewritten history); [] for an ordinary next turn."""
        shared = 0
        for a, b in zip(old.keys, keys, strict=False):
            if a != b:
                break
            shared += 1
        end = old.input_pages if old.input_pages > 0 else len(old.keys)
        if shared >= end or shared >= len(old.keys):
            return []
        return old.keys[shared:]

    def on_tool_call(self, sid: str) -> bool:
        """A turn of sid ended in a tool call (its next request is on the way):
        from now on it ranks as a conversation. False for an unknown session."""
        with self._lock:
            rec = self._sessions.get(sid)
            if rec is None:
                return False
            rec.tool_calls += 1
            self._changed()
        l3_metrics.inc("session_tool_turns")
        return True

    def demoted(self, key: str) -> bool:
        with self._lock:
            return key in self._demoted and key not in self._by_key

    def open(self, sid: str, priority: int | None = None) -> bool:
        if not valid_session_id(sid):
            return False
        with self._lock:
            old = self._sessions.get(sid)
            rec = old.copy() if old else SessionRecord(sid, implicit=is_implicit_id(sid))
            if priority is not None:
                rec.priority = priority
            rec.last_use, rec.open = self._now(), True
            self._put(rec)
            self._changed()
        return True

    def close(self, sid: str) -> bool:
        with self._lock:
            rec = self._sessions.get(sid)
            if rec is None or not rec.open:
                return False
            rec.open = False
            rec.last_use = self._now()
            self._changed()
        l3_metrics.inc("session_closed")
        return True

    def drop(self, sid: str) -> bool:
        with self._lock:
            if sid not in self._sessions:
                return False
            self._unindex(sid)
            self._changed()
        return True

    def set_priority(self, sid: str, priority: int) -> bool:
        with self._lock:
            rec = self._sessions.get(sid)
            if rec is None:
                return False
            rec.priority = int(priority)
            self._changed()
        return True

    def get(self, sid: str) -> SessionRecord | None:
        with self._lock:
            r = self._sessions.get(sid)
            return None if r is None else r.copy()

    def is_open(self, sid: str) -> bool:
        with self._lock:
            r = self._sessions.get(sid)
            return r is not None and r.open

    def records(self) -> list[SessionRecord]:
        with self._lock:
            return [r.copy() for r in self._sessions.values()]

    # -------------------------------------------------------- classification
    def rank(self, key: str) -> tuple:
        """Eviction sort key of a page key (smaller = evicted earlier), without
        the LRU tie-break the caller appends."""
        owners = self._by_key.get(key)
        if not owners:
            return (DEMOTED,) if key in self._demoted else (PLAIN,)
        best: tuple | None = None
        for sid, depth in owners.items():
            r = self._sessions[sid]
            if r.one_off():  # a stray prompt so far: not protected like a conversation
                t = (CLOSED, 0, r.last_use, -depth)
            elif r.open:
                t = (OPEN, r.priority, r.last_use, -depth)
            else:
                t = (CLOSED, 0, r.last_use, -depth)
            if best is None or t > best:
                best = t
        assert best is not None
        return best

    def victims(self, stems: Iterable[str]) -> Iterator[tuple[str, int]]:
        """(stem, class) in eviction order; stems given oldest-first (LRU).

        Lazy: plain pages are yielded in LRU order as the walk meets them, so
        an eviction that plain pages satisfy never sorts; the protected ones
        are sorted only once the plain ones are used up. Demoted pages (the
        stale tails of rewritten histories) go before all of them."""
        stems = list(stems)
        if self._demoted:
            for s in stems:
                with self._lock:
                    r = self.rank(key_of_stem(s))
                if r[0] == DEMOTED:
                    yield s, DEMOTED
        protected: list[tuple[tuple, int, str]] = []
        for i, s in enumerate(stems):
            with self._lock:
                r = self.rank(key_of_stem(s))
            if r[0] == DEMOTED:
                continue
            if r[0] == PLAIN:
                yield s, PLAIN
            else:
                protected.append((r, i, s))
        protected.sort(key=lambda t: (t[0], t[1]))
        for r, _, s in protected:
            yield s, r[0]

    def order(self, stems: Iterable[str]) -> list[str]:
        """Stems in eviction order (stems given oldest-first, i.e. LRU order)."""
        return [s for s, _ in self.victims(stems)]

    def class_of(self, key: str) -> int:
        with self._lock:
            return self.rank(key)[0]

    def stats(self, sizes: Iterable[tuple[str, int]]) -> dict[str, Any]:
        """Retained bytes/pages per class over (stem, size) pairs."""
        out = {f"{n}_{u}": 0 for n in CLASS_NAMES for u in ("bytes", "pages")}
        with self._lock:
            for stem, size in sizes:
                c = CLASS_NAMES[self.rank(key_of_stem(stem))[0]]
                out[f"{c}_bytes"] += size
                out[f"{c}_pages"] += 1
            out["sessions_open"] = sum(r.open for r in self._sessions.values())
            out["sessions_closed"] = sum(not r.open for r in self._sessions.values())
        return out

    # ---------------------------------------------------------- persistence
    def flush(self) -> bool:
        """Write the table now if it changed (table writer only). False on error."""
        if not self.writer:
            return True
        with self._io_lock:
            with self._lock:
                version = self._version
                if version == self._saved_version:
                    return True
                snap = [r.copy() for r in self._sessions.values()]
            try:
                table.save(self.dirs, self.mid, snap)
            except OSError as e:
                l3_metrics.inc("session_table_errors")
                cause = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else type(e).__name__
                if cause != self._table_failing:  # once per cause, until the table is written again
                    logger.warning(
                        "sglang-l3 sessions: cannot write the session table: %s; retried every %.0f s and at "
                        "each change, counted (session_table_errors), not logged again for this cause",
                        e,
                        self.table_retry_s,
                    )
                    self._table_failing = cause
                return False
            if self._table_failing is not None:
                logger.warning("sglang-l3 sessions: the session table is written again")
                self._table_failing = None
            self._saved_version = version
            return True

    def _writer_loop(self) -> None:
        while not self._closed:
            # while the table cannot be written, try again now and then without a change
            self._wake.wait(self.table_retry_s if self._table_failing is not None else None)
            self._wake.clear()
            if self._closed:
                break
            self.flush()

    def close_registry(self) -> None:
        self.flush()
        self._closed = True
        self._wake.set()


def open_retention(dirs: Any, mid: str, shard: Any) -> SessionRetention:
    """The store's registry; rank 0 (of TP/PP/CP) writes the table."""
    writer = shard.tp_rank == 0 and shard.pp_rank == 0 and shard.cp_rank == 0
    return SessionRetention(dirs, mid, writer=writer)


def make_session_evictor(base: type, retention: SessionRetention, counters: Any) -> type:
    """Subclass of upstream's LRUFileEvictor whose victims follow the session
    classes; everything else (reserve/commit/abort/touch, the cap, the
    free-space floor, pending-write protection) is upstream's."""

    class SessionAwareEvictor(base):
        def _evict_while(self, should_continue: Callable[[int], bool]) -> int:
            if not self._lru or not should_continue(0):
                return 0
            reclaimed = 0
            # a snapshot of the keys (the walk deletes); classes are looked up lazily
            for stem, cls_id in retention.victims(list(self._lru)):
                if not should_continue(reclaimed):
                    break
                size = self._lru.get(stem)
                if size is None or stem in self._pending_writes:
                    continue
                try:
                    os.remove(os.path.join(self.file_path, f"{stem}.bin"))
                    freed = size
                except FileNotFoundError:
                    freed = 0
                except OSError as e:
                    logger.warning("sglang-l3 store: eviction of %s failed: %s", stem, e)
                    break
                del self._lru[stem]
                self._total_bytes -= size
                reclaimed += freed
                cls = CLASS_NAMES[cls_id]
                counters.inc(f"evicted_{cls}")
                l3_metrics.inc("l3_evictions", cls)
                if self._on_evict is not None:
                    self._on_evict(stem)
            return reclaimed

        def sizes(self) -> list[tuple[str, int]]:
            with self._lock:
                return list(self._lru.items())

    return SessionAwareEvictor


__all__ = [
    "CLASS_NAMES",
    "DEMOTED",
    "MAX_IMPLICIT",
    "SessionRetention",
    "key_of_stem",
    "make_session_evictor",
    "open_retention",
]
