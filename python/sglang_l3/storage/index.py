"""Offline view of a store directory: scan, stats, restorable coverage,
verify, evict, clear. Used by `sglang-l3 store` and `doctor`; torch- and
sglang-free. Safe to run next to a live server (it only renames/unlinks
whole files; the server treats a vanished page as a miss).

Restorable coverage (issue 7): the fraction of KV bytes in L3 that lie at or
before a stored Mamba state of the same prefix. Each KV page header records
its `prior` key in the hash chain (from HiCacheStorageExtraInfo.prefix_keys,
or the previous key of the same batch); a Mamba state is stored under the key
of the KV page it ends at. Walking `prior` links back from every Mamba key
marks the covered pages. Links the writer did not know (prefix keys are only
passed with `hicache_storage_pass_prefix_keys: true`) make the figure a lower
bound, reported as `exact: false`.

Every function takes the store root (checked with safety.check_store; an
unsafe store raises UnsafeStoreError) or an opened `StoreDirs`. Files are
opened relative to the checked directories and never through a link; a link
or special file at a page's name is a stray here.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Union

from sglang_l3.storage import writers
from sglang_l3.storage.format import (
    BLOCK_BYTES,
    FIXED,
    META_MAX,
    HeaderError,
    PageName,
    block_sum,
    decode_header,
    parse_page_name,
)
from sglang_l3.storage.safety import (
    StoreDirs,
    UnsafeFileError,
    open_file,
    valid_key,
    valid_mid,
    valid_pool,
)

KV_POOL = "kv"
MAMBA_POOL = "mamba"
Root = Union[str, "os.PathLike[str]", StoreDirs]


@dataclass
class PageEntry:
    name: PageName
    path: str
    size: int
    mtime: float
    prior: str | None = None
    depth: int = -1
    header_error: str | None = None


@dataclass
class Scan:
    root: str
    pages: list[PageEntry] = field(default_factory=list)
    strays: list[tuple[str, int]] = field(default_factory=list)
    quarantine: list[tuple[str, int]] = field(default_factory=list)
    tmp: list[tuple[str, int]] = field(default_factory=list)
    models: dict[str, dict] = field(default_factory=dict)


@contextmanager
def opened(root: Root) -> Iterator[StoreDirs]:
    """The store's checked directories (without creating any)."""
    if isinstance(root, StoreDirs):
        yield root
        return
    dirs = StoreDirs(root, create=False)
    try:
        yield dirs
    finally:
        dirs.close()


def _names(dirs: StoreDirs, sub: str) -> list[str]:
    if not dirs.has(sub):
        return []
    try:
        return sorted(os.listdir(dirs.fd(sub)))
    except OSError:
        return []


def page_name_of(filename: str) -> PageName | None:
    """A parsed page name whose parts are all valid (fullmatch), else None."""
    n = parse_page_name(filename)
    if n is None or not (valid_key(n.key) and valid_pool(n.pool) and valid_mid(n.mid)):
        return None
    return n


def _read_header(dirs: StoreDirs, name: str):
    fd = dirs.open_file("pages", name)
    try:
        size = os.fstat(fd).st_size
        return decode_header(os.pread(fd, FIXED + META_MAX + 8 * 4096, 0), size)
    finally:
        os.close(fd)


def read_header_only(path: str):
    """Header of one page file (never through a link)."""
    head, name = os.path.split(os.path.abspath(path))
    dfd = os.open(head, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_file(dfd, name)
    finally:
        os.close(dfd)
    try:
        return decode_header(os.pread(fd, FIXED + META_MAX + 8 * 4096, 0), os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _size(st: os.stat_result | None) -> int:
    return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else 0


def scan(root: Root, *, headers: bool = False) -> Scan:
    """List pages (parsed names, sizes, mtimes; chain links when headers=True)."""
    with opened(root) as dirs:
        s = Scan(root=str(dirs.root))
        for n in _names(dirs, "pages"):
            kind, st = dirs.classify("pages", n)
            if st is None:
                continue
            name = page_name_of(n)
            if name is None or kind != "file":
                s.strays.append((n, _size(st)))
                continue
            ent = PageEntry(name, dirs.path("pages", n), st.st_size, st.st_mtime)
            if headers:
                try:
                    m = _read_header(dirs, n).meta
                    ent.prior, ent.depth = m.get("prior"), int(m.get("depth", -1))
                except (OSError, HeaderError, ValueError) as ex:
                    ent.header_error = getattr(ex, "reason", None) or getattr(ex, "kind", type(ex).__name__)
            s.pages.append(ent)
        for sub, out in (("quarantine", s.quarantine), ("tmp", s.tmp)):
            for n in _names(dirs, sub):
                _, st = dirs.classify(sub, n)
                if st is not None:
                    out.append((n, _size(st)))
        for n in _names(dirs, "models"):
            if n.endswith(".json") and valid_mid(n[:-5]):
                raw = dirs.read_file("models", n, max_bytes=1 << 20)
                try:
                    m = json.loads(raw) if raw is not None else None
                    if isinstance(m, dict) and m.get("mid") == n[:-5]:
                        s.models[m["mid"]] = m.get("identity") or {}
                except ValueError:
                    pass
        return s


def coverage(pages: Iterable[PageEntry]) -> dict[str, dict]:
    """Per model digest: KV bytes, bytes covered by a later-or-equal Mamba state."""
    groups: dict[tuple[str, str], tuple[dict[str, PageEntry], set[str]]] = {}
    for p in pages:
        kv, mamba = groups.setdefault((p.name.mid, p.name.shard), ({}, set()))
        if p.name.pool == KV_POOL:
            kv[p.name.key] = p
        elif p.name.pool == MAMBA_POOL:
            mamba.add(p.name.key)
    out: dict[str, dict] = {}
    for (mid, _shard), (kv, mamba) in groups.items():
        covered: set[str] = set()
        for m in mamba:
            cur: str | None = m
            while cur and cur in kv and cur not in covered:
                covered.add(cur)
                cur = kv[cur].prior
        r = out.setdefault(
            mid,
            {
                "kv_bytes": 0,
                "covered_bytes": 0,
                "kv_pages": 0,
                "covered_pages": 0,
                "unknown_links": 0,
            },
        )
        r["kv_bytes"] += sum(p.size for p in kv.values())
        r["kv_pages"] += len(kv)
        r["covered_bytes"] += sum(kv[k].size for k in covered)
        r["covered_pages"] += len(covered)
        r["unknown_links"] += sum(1 for p in kv.values() if p.prior is None)
    for r in out.values():
        r["fraction"] = r["covered_bytes"] / r["kv_bytes"] if r["kv_bytes"] else 0.0
        r["exact"] = r["unknown_links"] == 0
    return out


def stats(s: Scan, *, with_coverage: bool = True) -> dict:
    models: dict[str, dict] = {}
    for p in s.pages:
        m = models.setdefault(
            p.name.mid,
            {
                "mid": p.name.mid,
                "model": s.models.get(p.name.mid, {}).get("model", "?"),
                "pools": {},
                "shards": set(),
                "pages": 0,
                "bytes": 0,
            },
        )
        pool = m["pools"].setdefault(p.name.pool, {"pages": 0, "bytes": 0})
        pool["pages"] += 1
        pool["bytes"] += p.size
        m["pages"] += 1
        m["bytes"] += p.size
        m["shards"].add(p.name.shard)
    if with_coverage:
        for mid, cov in coverage(s.pages).items():
            models[mid]["coverage"] = cov
    for m in models.values():
        m["shards"] = sorted(m["shards"])
    reasons: dict[str, int] = {}
    for name, _ in s.quarantine:
        parts = name.split("-", 2)
        reason = parts[1] if len(parts) == 3 else "?"
        reasons[reason] = reasons.get(reason, 0) + 1
    return {
        "root": s.root,
        "pages": len(s.pages),
        "bytes": sum(p.size for p in s.pages),
        "models": sorted(models.values(), key=lambda m: -m["bytes"]),
        "quarantined": {
            "files": len(s.quarantine),
            "bytes": sum(b for _, b in s.quarantine),
            "by_reason": reasons,
        },
        "strays": len(s.strays),
        "tmp": len(s.tmp),
    }


def verify_page(path: str, dirs: StoreDirs | None = None) -> str | None:
    """Full re-check of one page file: header, name vs header, every block
    checksum. Returns a reason tag, or None when the page is good."""
    base = os.path.basename(path)
    name = page_name_of(base)
    try:
        if dirs is not None:
            fd = dirs.open_file("pages", base)
        else:
            with opened(os.path.dirname(os.path.dirname(os.path.abspath(path)))) as d:
                fd = d.open_file("pages", base)
    except UnsafeFileError as e:
        return e.kind
    except FileNotFoundError:
        return None  # evicted meanwhile
    except OSError as e:
        return f"io_error:{e.errno}"
    try:
        size = os.fstat(fd).st_size
        h = decode_header(os.pread(fd, min(size, FIXED + META_MAX + 8 * 4096), 0), size)
        m = h.meta
        if name is None or (
            m.get("key"),
            m.get("pool"),
            m.get("pool_digest"),
            m.get("mid"),
            m.get("shard"),
        ) != (name.key, name.pool, name.pool_digest, name.mid, name.shard):
            return "identity"
        for i, want in enumerate(h.sums):
            n = min(BLOCK_BYTES, h.payload_len - i * BLOCK_BYTES)
            block = os.pread(fd, n, h.header_len + i * BLOCK_BYTES)
            if len(block) != n or block_sum([memoryview(block)]) != want:
                return "checksum"
    except HeaderError as e:
        return e.reason
    except OSError as e:
        return f"io_error:{e.errno}"
    finally:
        os.close(fd)
    return None


def quarantine_file(root: Root, path: str, reason: str) -> bool:
    """Move pages/<name> (a link itself, never its target) into quarantine/."""
    base = os.path.basename(path)
    with opened(root) as dirs:
        try:
            os.rename(
                base,
                f"{time.time_ns()}-{reason}-{base}",
                src_dir_fd=dirs.fd("pages"),
                dst_dir_fd=dirs.fd("quarantine"),
            )
            return True
        except (OSError, KeyError):
            return False


def _remove(dirs: StoreDirs, sub: str, name: str) -> bool:
    """Unlink (a link is removed, its target untouched); a directory planted
    where a file belongs is removed as a tree (rmtree follows no links)."""
    kind, _ = dirs.classify(sub, name)
    if kind == "missing":
        return True
    try:
        if kind == "directory":
            shutil.rmtree(name, dir_fd=dirs.fd(sub))
        else:
            os.unlink(name, dir_fd=dirs.fd(sub))
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def verify(
    root: Root,
    *,
    quarantine: bool = True,
    repair: bool = False,
    progress: Callable[[int, int, int], None] | None = None,
) -> dict:
    """Re-check every page. repair=True also removes dead writers' tmp files."""
    with opened(root) as dirs:
        s = scan(dirs)
        total_bytes = sum(p.size for p in s.pages)
        bad: list[tuple[str, str]] = []
        done_bytes = 0
        for i, p in enumerate(sorted(s.pages, key=lambda p: p.path)):
            reason = verify_page(p.path, dirs)
            if reason is not None:
                bad.append((os.path.basename(p.path), reason))
                if quarantine or repair:
                    quarantine_file(dirs, p.path, reason)
            done_bytes += p.size
            if progress is not None:
                progress(i + 1, len(s.pages), done_bytes)
        for name, _ in s.strays:
            kind, _st = dirs.classify("pages", name)
            reason = "stray" if kind in ("file", "missing") else kind
            bad.append((name, reason))
            if quarantine or repair:
                quarantine_file(dirs, name, reason)
        tmp_removed = writers.sweep_tmp(dirs) if repair else (0, 0)
        return {
            "checked": len(s.pages),
            "bytes": total_bytes,
            "bad": bad,
            "quarantined": quarantine or repair,
            "tmp_removed": tmp_removed[0],
            "tmp_freed_bytes": tmp_removed[1],
        }


def store_bytes(s: Scan) -> int:
    """What evict counts as the store: pages + quarantine."""
    return sum(p.size for p in s.pages) + sum(b for _, b in s.quarantine)


def plan_evict(s: Scan, target_bytes: int) -> list[tuple[str, str, int]]:
    """(subdir, name, bytes) to remove: quarantine first, then pages least
    recently used first (mtime; reads refresh it), until <= target_bytes."""
    total = store_bytes(s)
    victims = [("quarantine", n, b) for n, b in sorted(s.quarantine)]
    victims += [("pages", os.path.basename(p.path), p.size) for p in sorted(s.pages, key=lambda p: (p.mtime, p.path))]
    out = []
    for v in victims:
        if total <= target_bytes:
            break
        out.append(v)
        total -= v[2]
    return out


def remove(root: Root, victims: Iterable[tuple[str, str, int]]) -> tuple[int, int]:
    """Remove planned victims; returns (files removed, bytes freed)."""
    removed = freed = 0
    with opened(root) as dirs:
        for sub, name, size in victims:
            if _remove(dirs, sub, name):
                removed += 1
                freed += size
    return removed, freed


def evict_to(root: Root, target_bytes: int) -> dict:
    """Shrink pages + quarantine to target_bytes (and remove dead writers' tmp files)."""
    with opened(root) as dirs:
        s = scan(dirs)
        total = store_bytes(s)
        removed, freed = remove(dirs, plan_evict(s, target_bytes))
        tmp = writers.sweep_tmp(dirs)
        return {
            "removed": removed,
            "freed_bytes": freed,
            "now_bytes": total - freed,
            "tmp_removed": tmp[0],
            "tmp_freed_bytes": tmp[1],
        }


def match_model(s: Scan, model: str) -> set[str]:
    mids = {p.name.mid for p in s.pages} | set(s.models)
    return {m for m in mids if (len(model) >= 4 and m.startswith(model)) or s.models.get(m, {}).get("model") == model}


def plan_clear(s: Scan, model: str | None = None) -> tuple[list[tuple[str, str, int]], set[str] | None]:
    """Every page (and the quarantine and strays), or one model's pages."""
    mids = match_model(s, model) if model else None
    victims = [("pages", os.path.basename(p.path), p.size) for p in s.pages if mids is None or p.name.mid in mids]
    if mids is None:
        victims += [("quarantine", n, b) for n, b in s.quarantine]
        victims += [("pages", n, b) for n, b in s.strays]
    return victims, mids


def clear(root: Root, model: str | None = None) -> dict:
    with opened(root) as dirs:
        s = scan(dirs)
        victims, mids = plan_clear(s, model)
        pages = [v for v in victims if v[0] == "pages" and page_name_of(v[1]) is not None]
        removed, freed = remove(dirs, pages)
        others, freed_others = remove(dirs, [v for v in victims if v not in pages])
        tmp = writers.sweep_tmp(dirs)
        return {
            "removed": removed,
            "files_removed": removed + others,
            "freed_bytes": freed + freed_others,
            "models": sorted(mids) if mids is not None else "all",
            "tmp_removed": tmp[0],
            "tmp_freed_bytes": tmp[1],
        }
