"""The persisted session table: one small file per model identity in the store.

`<store>/models/<mid>.sessions` holds, for every session the server has seen,
the page-key chain of its latest context, its token count, priority, state
(open/closed) and last use. It is what lets a session keep its L3 retention
across a restart and what `sglang-l3 sessions` lists offline.

Every byte of the table goes through `read_table_bytes` / `replace_table_bytes`
(the only two functions here that touch the filesystem), so hardening the
store's file access (O_NOFOLLOW, lstat checks) has one place to look. The
file is replaced atomically (tmp in the store's tmp/, fsync, rename): a crash
leaves the previous table or the new one, never half of either. A corrupt or
foreign table is ignored with a logged reason; serving starts with no sessions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeGuard

from sglang_l3.storage.safety import StoreDirs, UnsafeStoreError, valid_key

logger = logging.getLogger(__name__)

FORMAT = "sglang-l3-sessions"
VERSION = 1
SUFFIX = ".sessions"
MAX_TABLE_BYTES = 256 * 2**20  # refuse to parse anything larger (not ours / damaged)
MAX_ID_LEN = 256
# Ids the server mints for implicit sessions (requests without a session_id,
# sglang_l3.sessions.implicit); an explicit id of this form counts as implicit.
IMPLICIT_PREFIX = "implicit-"


class TableError(ValueError):
    """The table cannot be used; the message is the logged reason."""


@dataclass
class SessionRecord:
    id: str
    keys: list[str] = field(default_factory=list)  # page-key chain of the latest context
    tokens: int = 0
    priority: int = 0  # larger = retained longer among open sessions
    last_use: float = 0.0  # wall-clock seconds
    open: bool = True
    implicit: bool = False  # named by the server (no session_id from the client)
    turns: int = 0  # turns queued since this server (or table) first saw it
    input_pages: int = 0  # full pages of the last turn's input up to its end point (implicit_sessions.end_pages)
    tool_calls: int = 0  # turns that ended in a tool call (patch tool-call-turns)
    # the latest turn's end points, [tokens, hex digest] (sglang_l3.sessions.implicit): how an
    # implicit session is continued after a restart
    ends: list[list[Any]] = field(default_factory=list)
    # the first turn's input end point, [tokens, hex digest] ([]: none recorded): a turn that
    # rewrote the history but kept its start (a client's compaction) continues from it
    root: list[Any] = field(default_factory=list)

    def one_off(self) -> bool:
        """An implicit session with one turn and no tool call so far: a stray
        prompt, not (yet) a conversation."""
        return self.implicit and self.turns < 2 and self.tool_calls == 0

    def copy(self) -> SessionRecord:
        return replace(self, keys=list(self.keys), ends=[list(e) for e in self.ends], root=list(self.root))


def is_implicit_id(sid: object) -> bool:
    return isinstance(sid, str) and sid.startswith(IMPLICIT_PREFIX)


def valid_session_id(sid: object) -> TypeGuard[str]:
    return isinstance(sid, str) and 0 < len(sid) <= MAX_ID_LEN and sid.isprintable()


# ------------------------------------------------------------------ file I/O
def table_name(mid: str) -> str:
    return f"{mid}{SUFFIX}"


def read_table_bytes(dirs: StoreDirs, name: str) -> bytes | None:
    """The table's bytes (through the store's descriptor-relative, link-refusing
    helpers), or None when there is none. A link, a directory, a file of
    another user or an oversized file is refused (TableError)."""
    kind, _ = dirs.classify("models", name)
    if kind == "missing":
        return None
    if kind != "file":
        raise TableError(f"{dirs.path('models', name)} is a {kind}, not a table of ours")
    data = dirs.read_file("models", name, MAX_TABLE_BYTES)
    if data is None:
        raise TableError(f"{dirs.path('models', name)} is unreadable or over {MAX_TABLE_BYTES} bytes")
    return data


def replace_table_bytes(dirs: StoreDirs, name: str, data: bytes) -> None:
    """Atomically replace the table (tmp/ + fsync + rename; raises OSError)."""
    dirs.replace_file("models", name, data, durable=True)


# ------------------------------------------------------------------ encoding
def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def encode(mid: str, records: list[SessionRecord]) -> bytes:
    body = json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "mid": mid,
            "sessions": [asdict(r) for r in sorted(records, key=lambda r: r.id)],
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    return json.dumps({"sha256": _digest(body)}).encode() + b"\n" + body


def _record(d: object) -> SessionRecord:
    if not isinstance(d, dict):
        raise TableError("a session entry is not an object")
    sid, keys = d.get("id"), d.get("keys")
    if not valid_session_id(sid):
        raise TableError(f"invalid session id {sid!r}")
    if not isinstance(keys, list) or not all(valid_key(k) for k in keys):
        raise TableError(f"session {sid!r}: invalid page-key chain")
    tokens, priority, last_use, is_open = (
        d.get("tokens"),
        d.get("priority"),
        d.get("last_use"),
        d.get("open"),
    )
    if not (
        isinstance(tokens, int)
        and tokens >= 0
        and isinstance(priority, int)
        and isinstance(last_use, (int, float))
        and isinstance(is_open, bool)
    ):
        raise TableError(f"session {sid!r}: malformed fields")
    # fields added after version 1 was written: optional, with their defaults
    implicit, turns, input_pages = d.get("implicit", False), d.get("turns", 0), d.get("input_pages", 0)
    tool_calls = d.get("tool_calls", 0)
    ends, root = d.get("ends", []), d.get("root", [])
    if not (
        isinstance(implicit, bool)
        and isinstance(turns, int)
        and turns >= 0
        and isinstance(input_pages, int)
        and 0 <= input_pages <= len(keys)
        and isinstance(tool_calls, int)
        and tool_calls >= 0
        and _valid_ends(ends)
        and (root == [] or _valid_ends([root]))
    ):
        raise TableError(f"session {sid!r}: malformed fields")
    return SessionRecord(
        sid,
        list(keys),
        tokens,
        priority,
        float(last_use),
        is_open,
        implicit,
        turns,
        input_pages,
        tool_calls,
        [list(e) for e in ends],
        list(root),
    )


MAX_ENDS = 4


def _valid_ends(ends: object) -> bool:
    """[[tokens, 32 hex digits], ...]: at most MAX_ENDS end points."""
    return (
        isinstance(ends, list)
        and len(ends) <= MAX_ENDS
        and all(
            isinstance(e, list)
            and len(e) == 2
            and isinstance(e[0], int)
            and not isinstance(e[0], bool)
            and e[0] > 0
            and isinstance(e[1], str)
            and len(e[1]) == 32
            and all(c in "0123456789abcdef" for c in e[1])
            for e in ends
        )
    )


def decode(data: bytes, mid: str | None) -> tuple[str, list[SessionRecord]]:
    """(mid, records); raises TableError with the reason. mid=None accepts any."""
    head, sep, body = data.partition(b"\n")
    if not sep:
        raise TableError("truncated (no header line)")
    try:
        want = json.loads(head)["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise TableError(f"unreadable header: {e}") from e
    if want != _digest(body):
        raise TableError("checksum mismatch (damaged or partly written)")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise TableError(f"unreadable body: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TableError("not a sglang-l3 session table")
    if doc.get("version") != VERSION:
        raise TableError(f"table version {doc.get('version')!r}, this build reads {VERSION}")
    if mid is not None and doc.get("mid") != mid:
        raise TableError(f"table of another model identity ({doc.get('mid')!r}, serving {mid!r})")
    sessions = doc.get("sessions")
    if not isinstance(sessions, list):
        raise TableError("sessions is not a list")
    return str(doc.get("mid")), [_record(d) for d in sessions]


def load(dirs: StoreDirs, mid: str) -> tuple[list[SessionRecord], str | None]:
    """(records, reason): reason is None when the table was read (or absent),
    else why it was ignored (logged here)."""
    name = table_name(mid)
    try:
        data = read_table_bytes(dirs, name)
        if data is None:
            return [], None
        return decode(data, mid)[1], None
    except TableError as e:
        reason = str(e)
    except OSError as e:
        reason = f"cannot read: {e}"
    logger.warning(
        "sglang-l3 sessions: ignoring session table %s: %s",
        dirs.path("models", name),
        reason,
    )
    return [], reason


def save(dirs: StoreDirs, mid: str, records: list[SessionRecord]) -> None:
    replace_table_bytes(dirs, table_name(mid), encode(mid, records))


def table_path(root: Any, mid: str) -> str:
    return os.path.join(str(root), "models", table_name(mid))


def list_tables(root: Any) -> list[str]:
    """Names (in models/) of every session table in a store directory."""
    d = os.path.join(str(root), "models")
    try:
        return sorted(n for n in os.listdir(d) if n.endswith(SUFFIX))
    except FileNotFoundError:
        return []


__all__ = [
    "IMPLICIT_PREFIX",
    "SessionRecord",
    "TableError",
    "decode",
    "encode",
    "is_implicit_id",
    "list_tables",
    "load",
    "read_table_bytes",
    "replace_table_bytes",
    "save",
    "table_path",
    "valid_session_id",
]


def session_rows(root: str, model: str | None = None) -> list[dict[str, Any]]:
    """One dict per recorded session of the store at `root` (optionally one model's:
    digest prefix or name): state, priority, tokens, chain pages, pages stored, the
    restorable prefix, bytes, last use and the key chain. A table that cannot be read
    is a row with `table` and `error`. Offline: reads page names and tables only."""
    return session_inventory(root, model)[0]


def session_inventory(root: str, model: str | None = None) -> tuple[list[dict[str, Any]], int]:
    """`session_rows` and the bytes of every page file of the store (all models and
    ranks: its use against the cap), from one scan of pages/. Reads the disk: a server
    runs it off its event loop."""
    from sglang_l3.storage import index

    scan = index.scan(root)
    total = sum(p.size for p in scan.pages)
    mids = index.match_model(scan, model) if model else None
    sizes: dict[tuple[str, str], int] = {}
    kv: set[tuple[str, str]] = set()
    for p in scan.pages:
        k = (p.name.mid, p.name.key)
        sizes[k] = sizes.get(k, 0) + p.size
        if p.name.pool == "kv":
            kv.add(k)
    out: list[dict[str, Any]] = []
    names = list_tables(root)
    if not names:
        return out, total
    try:
        dirs = StoreDirs(root, create=False)
    except (UnsafeStoreError, OSError) as e:
        return [{"table": root, "error": str(e)}], total
    with dirs:
        tables = []
        for name in names:
            try:
                tables.append(decode(read_table_bytes(dirs, name) or b"", None))
            except (TableError, OSError) as e:
                out.append({"table": dirs.path("models", name), "error": str(e)})
    for mid, records in tables:
        if mids is not None and mid not in mids:
            continue
        for r in records:
            present = [k for k in r.keys if (mid, k) in kv]
            prefix = 0
            while prefix < len(r.keys) and (mid, r.keys[prefix]) in kv:
                prefix += 1
            out.append(
                {
                    "mid": mid,
                    "model": scan.models.get(mid, {}).get("model", "?"),
                    "id": r.id,
                    "state": "open" if r.open else "closed",
                    "kind": "implicit" if r.implicit else "explicit",
                    "turns": r.turns,
                    "tool_calls": r.tool_calls,
                    "priority": r.priority,
                    "tokens": r.tokens,
                    "chain_pages": len(r.keys),
                    "stored_pages": len(present),
                    "restorable_pages": prefix,
                    "bytes": sum(sizes.get((mid, k), 0) for k in r.keys),
                    "last_use": r.last_use,
                    "keys": r.keys,
                }
            )
    return out, total
