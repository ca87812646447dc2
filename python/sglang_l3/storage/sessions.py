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
import stat
from dataclasses import asdict, dataclass, field

from sglang_l3.storage.safety import valid_key

logger = logging.getLogger(__name__)

FORMAT = "sglang-l3-sessions"
VERSION = 1
SUFFIX = ".sessions"
MAX_TABLE_BYTES = 256 * 2**20  # refuse to parse anything larger (not ours / damaged)
MAX_ID_LEN = 256


class TableError(ValueError):
    """The table cannot be used; the message is the logged reason."""


@dataclass
class SessionRecord:
    id: str
    keys: list[str] = field(
        default_factory=list
    )  # page-key chain of the latest context
    tokens: int = 0
    priority: int = 0  # larger = retained longer among open sessions
    last_use: float = 0.0  # wall-clock seconds
    open: bool = True


def valid_session_id(sid: object) -> bool:
    return isinstance(sid, str) and 0 < len(sid) <= MAX_ID_LEN and sid.isprintable()


def table_path(root: str, mid: str) -> str:
    return os.path.join(str(root), "models", f"{mid}{SUFFIX}")


# ------------------------------------------------------------------ file I/O
def read_table_bytes(path: str) -> bytes | None:
    """The table's bytes, or None when there is no table. A symlink, a
    non-regular file or an oversized file is refused (TableError)."""
    try:
        fd = os.open(
            path,
            os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
        )
    except FileNotFoundError:
        return None
    except OSError as e:
        raise TableError(f"cannot open {path}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TableError(f"{path} is not a regular file")
        if st.st_size > MAX_TABLE_BYTES:
            raise TableError(f"{path} is {st.st_size} bytes (limit {MAX_TABLE_BYTES})")
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def replace_table_bytes(path: str, data: bytes, tmp_dir: str) -> None:
    """Atomically replace the table at path with data (raises OSError)."""
    tmp = os.path.join(tmp_dir, f"{os.getpid()}-sessions-{os.path.basename(path)}.tmp")
    flags = (
        os.O_WRONLY
        | os.O_CREAT
        | os.O_TRUNC
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    fd = os.open(tmp, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} exists and is not a regular file; not replacing it")
    except FileNotFoundError:
        pass
    except OSError:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)
    try:
        dfd = os.open(
            os.path.dirname(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
        )
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # the rename is atomic either way; fsync of the dir is durability only


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
    return SessionRecord(sid, list(keys), tokens, priority, float(last_use), is_open)


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
        raise TableError(
            f"table version {doc.get('version')!r}, this build reads {VERSION}"
        )
    if mid is not None and doc.get("mid") != mid:
        raise TableError(
            f"table of another model identity ({doc.get('mid')!r}, serving {mid!r})"
        )
    sessions = doc.get("sessions")
    if not isinstance(sessions, list):
        raise TableError("sessions is not a list")
    return str(doc.get("mid")), [_record(d) for d in sessions]


def load(root: str, mid: str) -> tuple[list[SessionRecord], str | None]:
    """(records, reason): reason is None when the table was read (or absent),
    else why it was ignored (logged here)."""
    path = table_path(root, mid)
    try:
        data = read_table_bytes(path)
        if data is None:
            return [], None
        return decode(data, mid)[1], None
    except TableError as e:
        reason = str(e)
    except OSError as e:
        reason = f"cannot read: {e}"
    logger.warning("sglang-l3 sessions: ignoring session table %s: %s", path, reason)
    return [], reason


def save(root: str, mid: str, records: list[SessionRecord]) -> None:
    replace_table_bytes(
        table_path(root, mid), encode(mid, records), os.path.join(str(root), "tmp")
    )


def list_tables(root: str) -> list[str]:
    """Paths of every session table in a store directory."""
    d = os.path.join(str(root), "models")
    try:
        return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(SUFFIX))
    except FileNotFoundError:
        return []


__all__ = [
    "SessionRecord",
    "TableError",
    "decode",
    "encode",
    "list_tables",
    "load",
    "read_table_bytes",
    "replace_table_bytes",
    "save",
    "table_path",
    "valid_session_id",
]
