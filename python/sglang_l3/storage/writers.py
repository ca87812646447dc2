"""Which temporary files belong to a live writer, and removing the others.

Every process that writes into a store holds a shared flock on
`locks/<pid>.lock` for as long as it lives (the kernel drops it on any death,
kill -9 included), and names its temporary files `tmp/<pid>-….tmp`. A tmp file
is a dead writer's leftover only when no process holds that pid's lock *and*
no process with that pid is alive here (or the file is older than a day): the
lock covers writers in other pid namespaces sharing the directory, the pid
check covers writers that predate the lock. Used at server start-up and by
`sglang-l3 store evict | clear | verify --repair`.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time

from sglang_l3.storage.safety import StoreDirs, UnsafeFileError

_MAX_AGE_S = 24 * 3600
_FOREIGN_MIN_AGE_S = 60  # a tmp name without a pid: junk, but give a racing creator a minute
_held: dict[tuple[int, int, int], list[int]] = {}  # (pid, st_dev, st_ino of locks/) -> [fd, users]
_lock = threading.Lock()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_of(name: str) -> int | None:
    head = name.split("-", 1)[0].split(".", 1)[0]
    return int(head) if head.isdigit() and int(head) > 0 else None


def _lock_id(dirs: StoreDirs) -> tuple[int, int, int]:
    st = os.fstat(dirs.fd("locks"))
    return os.getpid(), st.st_dev, st.st_ino


def hold_writer_lock(dirs: StoreDirs) -> None:
    """Take the lock that marks this pid's tmp files live (shared by every
    store object of this process on the same directory; released by the last)."""
    if not dirs.has("locks"):
        return
    lid = _lock_id(dirs)
    with _lock:
        if lid in _held:
            _held[lid][1] += 1
            return
        _held[lid] = [_take(dirs, lid[0]), 1]


def release_writer_lock(dirs: StoreDirs) -> None:
    if not dirs.has("locks"):
        return
    lid = _lock_id(dirs)
    with _lock:
        ent = _held.get(lid)
        if ent is None:
            return
        ent[1] -= 1
        if ent[1] <= 0:
            del _held[lid]
            os.close(ent[0])  # the file stays; a later cleaner removes it


def _take(dirs: StoreDirs, pid: int) -> int:
    name = f"{pid}.lock"
    for _ in range(8):
        try:
            fd = dirs.open_file("locks", name, os.O_RDWR | os.O_CREAT)
        except FileExistsError:
            try:
                fd = dirs.open_file("locks", name, os.O_RDWR)
            except FileNotFoundError:
                continue
            except UnsafeFileError:  # a link / special file at our lock's name: remove it, retry
                dirs.remove("locks", name)
                continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        kind, now = dirs.classify("locks", name)
        mine = os.fstat(fd)
        if kind == "file" and now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # a cleaner removed the file between our open and our lock: retry
    raise OSError(f"cannot take the writer lock {dirs.path('locks', name)}")


def _lock_held(dirs: StoreDirs, pid: int) -> bool:
    if not dirs.has("locks"):
        return False
    try:
        fd = dirs.open_file("locks", f"{pid}.lock")
    except (OSError, ValueError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def writer_alive(dirs: StoreDirs, pid: int, age_s: float) -> bool:
    if _lock_held(dirs, pid):
        return True
    return _pid_alive(pid) and age_s < _MAX_AGE_S


def sweep_tmp(dirs: StoreDirs) -> tuple[int, int]:
    """Remove dead writers' tmp files (and anything in tmp/ that is not a
    regular file of ours: links are unlinked, never followed) and dead lock
    files. Returns (files removed, bytes freed)."""
    removed = freed = 0
    now = time.time()
    live: dict[int, tuple[bool, bool]] = {}  # pid -> (lock held, pid alive here)
    for name in _listdir(dirs, "tmp"):
        kind, st = dirs.classify("tmp", name)
        if st is None or kind == "directory":
            continue
        age = now - st.st_mtime
        pid = _pid_of(name)
        if kind == "file":
            if pid is None:
                if age < _FOREIGN_MIN_AGE_S:
                    continue
            else:
                if pid not in live:
                    live[pid] = (_lock_held(dirs, pid), _pid_alive(pid))
                held, running = live[pid]
                if held or (running and age < _MAX_AGE_S):
                    continue
        if dirs.remove("tmp", name):
            removed += 1
            freed += st.st_size if kind == "file" else 0
    for name in _listdir(dirs, "locks"):
        pid = _pid_of(name)
        if pid is None or pid == os.getpid() or _pid_alive(pid):
            continue
        _remove_dead_lock(dirs, name)
    return removed, freed


def _remove_dead_lock(dirs: StoreDirs, name: str) -> None:
    try:
        fd = dirs.open_file("locks", name)
    except UnsafeFileError:
        dirs.remove("locks", name)
        return
    except (OSError, ValueError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        dirs.remove("locks", name)  # under our exclusive lock: nobody holds it
    except BlockingIOError:
        pass
    finally:
        os.close(fd)


def _listdir(dirs: StoreDirs, sub: str) -> list[str]:
    if not dirs.has(sub):
        return []
    try:
        return os.listdir(dirs.fd(sub))
    except OSError:
        return []
