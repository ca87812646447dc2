"""`sglang-l3 doctor` section for the L3 store: location, owner, permissions,
free space, page / quarantine counts, settings. Read-only; torch-free."""

from __future__ import annotations

import os
import pwd
import stat
from typing import Any

from sglang_l3 import metrics
from sglang_l3.storage import index
from sglang_l3.storage.config import ConfigError, StoreSettings, fmt_bytes
from sglang_l3.storage.safety import UnsafeStoreError, check_dir, check_store


def _fmt(n: float) -> str:
    return fmt_bytes(n)


def _fs_type(path: str) -> str:
    best, fstype = "", "?"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and path.startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return fstype


def report(store_dir: str | None = None) -> dict[str, Any]:
    lines: list[str] = []
    data: dict[str, Any] = {}
    ok = True
    try:
        settings = StoreSettings.resolve({"store_dir": store_dir} if store_dir else {})
    except ConfigError as e:
        return {"ok": False, "lines": [f"store settings invalid: {e}"], "data": {"error": str(e)}}
    root = str(settings.root)
    data.update(
        dir=root,
        durability=settings.durability,
        odirect=settings.odirect,
        max_bytes=settings.max_bytes,
        min_free=settings.min_free,
        io_threads=settings.io_threads,
    )
    lines.append(
        f"store dir {root} (durability={settings.durability}, odirect={settings.odirect}, "
        f"cap={_fmt(settings.max_bytes) if settings.max_bytes else 'none'}, min free={settings.min_free})"
    )
    if root.startswith("/tmp/") or root == "/tmp":
        lines.append("  note: the store is under /tmp (often RAM-backed or cleaned at boot)")
    if not os.path.lexists(root):
        data["exists"] = False
        lines.append("  does not exist yet; it is created (mode 0700) on first start")
        return {"ok": True, "lines": lines, "data": data}
    data["exists"] = True
    if not os.path.isdir(root):  # a file or a dangling link: the server refuses it, say so once
        data["safe"] = False
        try:
            check_dir(root)
            reason = f"{root} is not a directory"
        except UnsafeStoreError as e:
            reason = str(e)
        lines.append(f"  UNUSABLE: {reason}")
        return {"ok": False, "lines": lines, "data": data}
    st = os.stat(root)
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    mode = stat.S_IMODE(st.st_mode)
    data.update(owner=owner, uid=st.st_uid, mode=f"{mode:04o}", fs=_fs_type(os.path.realpath(root)))
    try:
        check_store(root)  # the same check as the server and every `store` subcommand
        lines.append(f"  owner {owner}, mode {mode:04o}, filesystem {data['fs']}: ok")
        data["safe"] = True
    except UnsafeStoreError as e:
        data["safe"] = False
        lines.append(f"  UNSAFE: {e}")
        return {"ok": False, "lines": lines, "data": data}  # not read: the server would refuse it too
    vfs = os.statvfs(root)
    total, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    try:
        floor = settings.min_free_bytes(total)
    except ConfigError:
        floor = 0
    data.update(fs_total=total, fs_free=free, min_free_bytes=floor)
    low = floor and free < floor
    lines.append(
        f"  free space {_fmt(free)} of {_fmt(total)}"
        + (f" (below the {_fmt(floor)} floor: writes evict old pages first)" if low else "")
    )
    s = index.scan(root)
    st_ = index.stats(s, with_coverage=False)
    data.update(
        pages=st_["pages"],
        bytes=st_["bytes"],
        quarantined=st_["quarantined"]["files"],
        quarantined_bytes=st_["quarantined"]["bytes"],
        strays=st_["strays"],
        tmp=st_["tmp"],
        models=[{k: m[k] for k in ("mid", "model", "pages", "bytes")} for m in st_["models"]],
    )
    lines.append(
        f"  {st_['pages']} pages ({_fmt(st_['bytes'])}) from {len(st_['models'])} model identities; "
        f"{st_['quarantined']['files']} quarantined, {st_['strays']} stray, {st_['tmp']} tmp"
    )
    live = metrics.store_counters()
    if live:
        data["counters"] = live
    return {"ok": ok, "lines": lines, "data": data}
