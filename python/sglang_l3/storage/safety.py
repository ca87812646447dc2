"""Directory and name safety: the store may sit on a shared machine.

The store directory is created 0700. At start-up a directory owned by another
user, or writable by group/others, is refused (someone else could plant pages
that we would serve as KV). Keys and pool names are validated so a file name
can never leave the directory.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
POOL_RE = re.compile(r"^[a-z0-9_]{1,48}$")
SUBDIRS = ("pages", "tmp", "quarantine", "models")


class UnsafeStoreError(RuntimeError):
    """The store directory cannot be used safely; the message says how to fix it."""


def valid_key(key: object) -> bool:
    return isinstance(key, str) and KEY_RE.match(key) is not None


def valid_pool(pool: object) -> bool:
    return isinstance(pool, str) and POOL_RE.match(pool) is not None


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def check_dir(path: Path) -> None:
    """Refuse a directory we do not own or that group/others can write."""
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise UnsafeStoreError(f"store directory {path} does not exist") from e
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStoreError(f"store path {path} is not a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeStoreError(
            f"store directory {path} is owned by {_owner_name(st.st_uid)} (uid {st.st_uid}), "
            f"not by the serving user {_owner_name(me)} (uid {me}); refusing to read KV "
            f"pages another user controls. Use a directory you own "
            f"(SGLANG_L3_STORE_DIR or extra-config store_dir)."
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStoreError(
            f"store directory {path} is group- or world-writable (mode {mode:04o}); "
            f"anyone in that group could plant KV pages. Fix with: chmod 700 {path}"
        )


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


def ensure_store_dir(root: Path) -> Path:
    """Create (0700) or validate the store root and its subdirectories."""
    root = Path(root).expanduser().absolute()
    old = os.umask(0o077)
    try:
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except PermissionError as e:
            raise UnsafeStoreError(f"cannot create store directory {root}: {e}") from e
        _check_ancestors(root)
        check_dir(root)  # before creating anything inside someone else's directory
        for sub in SUBDIRS:
            try:
                os.mkdir(root / sub, 0o700)
            except FileExistsError:
                pass
    finally:
        os.umask(old)
    for sub in SUBDIRS:
        check_dir(root / sub)
    return root
