"""Directory, file and name safety: the store may sit on a shared machine.

Threat model (docs/operations.md): only the serving user may write the store.
The root and every subdirectory must be directories owned by that user and not
writable by group/others; anything else is refused with a message that says
why and how to fix it (`check_store`, shared by the server and every CLI
subcommand). Inside, no symbolic link is ever followed: files are opened
relative to opened, checked directory descriptors (`StoreDirs`) with
O_NOFOLLOW, checked with fstat/lstat to be regular files of ours, and created
with O_EXCL. Keys, pool names and model identities are validated with
`fullmatch` (`$` would accept a trailing newline), so a name never leaves its
directory.

Other modules that keep a file in the store (a table, a manifest) use
`StoreDirs.read_file` / `StoreDirs.replace_file` / `StoreDirs.open_file`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Self, Union

KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
POOL_RE = re.compile(r"[a-z0-9_]{1,48}")
MID_RE = re.compile(r"[0-9a-f]{12}")  # model identity digest (identity.ModelIdentity.digest)
# A file name inside a store subdirectory: one component, printable ASCII, no separators.
NAME_RE = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9_.@+=-]{1,255}")
# `store --model`: a model digest prefix or a served model name (an HF id or a path;
# only compared with manifests, never used as a path). Components are plain names.
_COMPONENT = r"(?!\.\.?(?:/|\Z))[A-Za-z0-9_.@+:=-]{1,128}"
MODEL_ARG_RE = re.compile(rf"/?{_COMPONENT}(?:/{_COMPONENT}){{0,15}}")
# Operator-chosen identity override (mixed into the model digest).
IDENTITY_OVERRIDE_RE = re.compile(r"[A-Za-z0-9_.:@+=-]{0,128}")
SUBDIRS = ("pages", "tmp", "quarantine", "models", "locks")

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

PathLike = Union[str, "os.PathLike[str]"]


class UnsafeStoreError(RuntimeError):
    """The store directory cannot be used safely; the message says how to fix it."""


class UnsafeFileError(OSError):
    """A name inside the store is not a regular file of ours (link, directory,
    FIFO/device, another user's file). `kind` is a short tag used as the
    quarantine reason: link | directory | special | foreign."""

    def __init__(self, kind: str, name: str, detail: str = ""):
        super().__init__(
            errno.ELOOP if kind == "link" else errno.EPERM,
            f"{name} is {detail or kind}, not a regular file of ours",
        )
        self.kind = kind
        self.name = name


def valid_key(key: object) -> bool:
    return isinstance(key, str) and KEY_RE.fullmatch(key) is not None


def valid_pool(pool: object) -> bool:
    return isinstance(pool, str) and POOL_RE.fullmatch(pool) is not None


def valid_mid(mid: object) -> bool:
    return isinstance(mid, str) and MID_RE.fullmatch(mid) is not None


def valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def valid_model_arg(model: object) -> bool:
    return isinstance(model, str) and MODEL_ARG_RE.fullmatch(model) is not None


def valid_identity_override(value: object) -> bool:
    return isinstance(value, str) and IDENTITY_OVERRIDE_RE.fullmatch(value) is not None


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def _kind_of(st: os.stat_result) -> str:
    m = st.st_mode
    if stat.S_ISLNK(m):
        return "a symbolic link"
    if stat.S_ISREG(m):
        return "a regular file"
    if stat.S_ISDIR(m):
        return "a directory"
    return "a special file (FIFO, socket or device)"


def _check_stat(path: PathLike, st: os.stat_result, *, what: str = "store directory") -> None:
    """The one owner/mode rule, for the root and every subdirectory."""
    if not stat.S_ISDIR(st.st_mode):
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeStoreError(
                f"{what} {path} is a symbolic link; the store follows no links inside its "
                f"directory. Fix: remove the link (rm {path}); it is recreated on the next start"
            )
        raise UnsafeStoreError(
            f"{what} {path} is not a directory (it is {_kind_of(st)}). Fix: point the store "
            f"at a directory (--dir / store_dir / SGLANG_L3_STORE_DIR) or move the file away"
        )
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeStoreError(
            f"{what} {path} is owned by {_owner_name(st.st_uid)} (uid {st.st_uid}), "
            f"not by the serving user {_owner_name(me)} (uid {me}); refusing to read KV "
            f"pages another user controls. Fix: use a directory you own "
            f"(SGLANG_L3_STORE_DIR or extra-config store_dir), or have its owner "
            f"run: chown -R {_owner_name(me)} {path}"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStoreError(
            f"{what} {path} is group- or world-writable (mode {mode:04o}); "
            f"anyone in that group could plant KV pages. Fix with: chmod 700 {path}"
        )


def check_dir(path: PathLike, *, follow: bool = True) -> None:
    """Refuse a directory we do not own or that group/others can write.
    follow=False also refuses a symbolic link (used for subdirectories)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError as e:
        raise UnsafeStoreError(f"store directory {path} does not exist") from e
    except NotADirectoryError as e:
        raise UnsafeStoreError(f"store path {path} lies under a file, not a directory") from e
    _check_stat(path, st)


def _check_ancestors(path: Path) -> None:
    """A world-writable ancestor without the sticky bit lets others swap our dir."""
    for parent in path.parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue
        mode = stat.S_IMODE(st.st_mode)
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX and st.st_uid != os.geteuid():
            raise UnsafeStoreError(
                f"store directory {path} lies under {parent}, which is world-writable "
                f"without the sticky bit (mode {mode:04o}); another user could replace "
                f"the store. Choose a location under a directory you control."
            )


def _norm(root: PathLike) -> Path:
    return Path(root).expanduser().absolute()


def check_store(root: PathLike, subdirs: Iterable[str] = SUBDIRS) -> Path:
    """The safety check shared by the server and every `sglang-l3 store`
    subcommand: ancestors, the root, and every subdirectory present (the named
    ones and any other directory found, so a table added later is covered).
    Creates nothing. Raises UnsafeStoreError with the reason and the fix."""
    root = _norm(root)
    _check_ancestors(root)
    check_dir(root)
    names = set(subdirs)
    try:
        with os.scandir(root) as it:
            for e in it:
                if e.name in names or e.is_dir(follow_symlinks=False):
                    names.add(e.name)
    except OSError as e:
        raise UnsafeStoreError(f"cannot list store directory {root}: {e}") from e
    for sub in sorted(names):
        try:
            st = os.lstat(root / sub)
        except FileNotFoundError:
            continue
        _check_stat(root / sub, st, what="store subdirectory")
    return root


def ensure_store_dir(root: PathLike, subdirs: Iterable[str] = SUBDIRS) -> Path:
    """Create (0700) or validate the store root and its subdirectories."""
    root = _norm(root)
    subdirs = tuple(subdirs)
    old = os.umask(0o077)
    try:
        if os.path.lexists(root) and not os.path.isdir(root):
            check_dir(root)  # a regular file / dangling link: a clear error, not FileExistsError
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except PermissionError as e:
            raise UnsafeStoreError(f"cannot create store directory {root}: {e}") from e
        except (FileExistsError, NotADirectoryError) as e:
            raise UnsafeStoreError(
                f"cannot create store directory {root}: a path component is not a directory ({e})"
            ) from e
        _check_ancestors(root)
        check_dir(root)  # before creating anything inside someone else's directory
        for sub in subdirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(root / sub, 0o700)
    finally:
        os.umask(old)
    return check_store(root, subdirs)


# ------------------------------------------------------------ opened directories
def _fstat_dir_ok(fd: int, path: PathLike, what: str) -> None:
    _check_stat(path, os.fstat(fd), what=what)


def open_file(dir_fd: int, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """Open `name` inside an opened store directory: never through a link, only
    a regular file owned by us. Creation always uses O_EXCL. Raises
    UnsafeFileError (an OSError) for a link / directory / special / foreign
    file, FileNotFoundError when absent, OSError(EPERM) for a bad name (EINVAL means "no O_DIRECT here")."""
    if not valid_name(name):  # an OSError, so IO paths treat it like any failed open
        raise OSError(errno.EPERM, f"invalid file name {name!r}")
    if flags & os.O_CREAT:
        flags |= os.O_EXCL
    try:
        # O_NONBLOCK: opening a FIFO planted at the name must not hang (no effect on files).
        fd = os.open(name, flags | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError("link", name, "a symbolic link") from e
        if e.errno == errno.EISDIR:
            raise UnsafeFileError("directory", name, "a directory") from e
        if e.errno == errno.ENXIO:
            raise UnsafeFileError("special", name, "a special file") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "directory" if stat.S_ISDIR(st.st_mode) else "special"
            raise UnsafeFileError(kind, name, _kind_of(st))
        if st.st_uid != os.geteuid():
            raise UnsafeFileError("foreign", name, f"owned by uid {st.st_uid}")
        if _O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def classify(dir_fd: int, name: str) -> tuple[str, os.stat_result | None]:
    """lstat `name` in an opened directory: ("missing", None), ("file", st) for
    a regular file of ours, or (kind, st) with kind link|directory|special|foreign."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return "missing", None
    m = st.st_mode
    if stat.S_ISLNK(m):
        return "link", st
    if stat.S_ISDIR(m):
        return "directory", st
    if not stat.S_ISREG(m):
        return "special", st
    if st.st_uid != os.geteuid():
        return "foreign", st
    return "file", st


class StoreDirs:
    """The store root and its subdirectories, opened once and checked through
    their descriptors: a directory swapped after the check cannot redirect IO.
    Every helper here is relative to these descriptors and follows no link."""

    def __init__(self, root: PathLike, subdirs: Iterable[str] = SUBDIRS, *, create: bool = True):
        subdirs = tuple(subdirs)
        self.root = ensure_store_dir(root, subdirs) if create else check_store(root, subdirs)
        self.root_fd = os.open(self.root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        self._fds: dict[str, int] = {}
        try:
            _fstat_dir_ok(self.root_fd, self.root, "store directory")
            for sub in subdirs:
                try:
                    fd = os.open(
                        sub,
                        os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC,
                        dir_fd=self.root_fd,
                    )
                except FileNotFoundError:
                    if create:
                        raise
                    continue
                except OSError as e:  # ELOOP / ENOTDIR: swapped since the check
                    raise UnsafeStoreError(f"store subdirectory {self.root / sub} is not a directory: {e}") from e
                self._fds[sub] = fd
                _fstat_dir_ok(fd, self.root / sub, "store subdirectory")
        except BaseException:
            self.close()
            raise

    def has(self, sub: str) -> bool:
        return sub in self._fds

    def fd(self, sub: str) -> int:
        return self._fds[sub]

    def path(self, sub: str, name: str = "") -> str:
        return os.path.join(self.root, sub, name) if name else os.path.join(self.root, sub)

    def open_file(self, sub: str, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
        return open_file(self._fds[sub], name, flags, mode)

    def classify(self, sub: str, name: str) -> tuple[str, os.stat_result | None]:
        return classify(self._fds[sub], name)

    def read_file(self, sub: str, name: str, max_bytes: int = 64 << 20) -> bytes | None:
        """The bytes of a regular file of ours, or None (absent, unsafe, too big)."""
        try:
            fd = self.open_file(sub, name)
        except (OSError, ValueError):
            return None
        try:
            if os.fstat(fd).st_size > max_bytes:
                return None
            chunks: list[bytes] = []
            n = 0
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    return b"".join(chunks)
                n += len(b)
                if n > max_bytes:
                    return None
                chunks.append(b)
        finally:
            os.close(fd)

    def replace_file(self, sub: str, name: str, data: bytes, *, durable: bool = False) -> None:
        """Atomically (re)place `sub/name` with `data`: a fresh O_EXCL file in
        tmp/ named `<pid>-…` (so a dead writer's leftover is recognised), then
        renamed over the name (rename replaces a link, never follows it)."""
        if not valid_name(name):
            raise ValueError(f"invalid file name {name!r}")
        tmp = f"{os.getpid()}-{uuid.uuid4().hex}.tmp"
        fd = self.open_file("tmp", tmp, os.O_WRONLY | os.O_CREAT)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self._fds["tmp"], dst_dir_fd=self._fds[sub])
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._fds["tmp"])
            raise
        if durable:
            os.fsync(self._fds[sub])

    def remove(self, sub: str, name: str) -> bool:
        """Unlink a name (a link is removed, its target untouched)."""
        try:
            os.unlink(name, dir_fd=self._fds[sub])
            return True
        except OSError:
            return False

    def close(self) -> None:
        for fd in list(self._fds.values()) + [getattr(self, "root_fd", -1)]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds.clear()
        self.root_fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_store_file(root: PathLike, sub: str, name: str, max_bytes: int = 64 << 20) -> bytes | None:
    """One-off safe read of `<root>/<sub>/<name>` (a table kept in the store):
    the store is checked like the server checks it; None when absent or unsafe."""
    with StoreDirs(root, (sub,), create=False) as dirs:
        return dirs.read_file(sub, name, max_bytes) if dirs.has(sub) else None


def replace_store_file(root: PathLike, sub: str, name: str, data: bytes, *, durable: bool = False) -> None:
    """One-off atomic write of `<root>/<sub>/<name>` (creating `sub` 0700 if needed)."""
    with StoreDirs(root, (*SUBDIRS, sub)) as dirs:
        dirs.replace_file(sub, name, data, durable=durable)
