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
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from sglang_l3.storage.format import (
    FIXED,
    META_MAX,
    BLOCK_BYTES,
    HeaderError,
    PageName,
    decode_header,
    block_sum,
    parse_page_name,
)

KV_POOL = "kv"
MAMBA_POOL = "mamba"


@dataclass
class PageEntry:
    name: PageName
    path: str
    size: int
    mtime: float
    prior: Optional[str] = None
    depth: int = -1
    header_error: Optional[str] = None


@dataclass
class Scan:
    root: str
    pages: list[PageEntry] = field(default_factory=list)
    strays: list[tuple[str, int]] = field(default_factory=list)
    quarantine: list[tuple[str, int]] = field(default_factory=list)
    tmp: list[tuple[str, int]] = field(default_factory=list)
    models: dict[str, dict] = field(default_factory=dict)


def _files(d: str) -> Iterable[os.DirEntry]:
    try:
        with os.scandir(d) as it:
            yield from it
    except FileNotFoundError:
        return


def read_header_only(path: str):
    with open(path, "rb", buffering=0) as f:
        buf = f.read(FIXED + META_MAX + 8 * 4096)
        size = os.fstat(f.fileno()).st_size
    return decode_header(buf, size)


def scan(root: str, *, headers: bool = False) -> Scan:
    """List pages (parsed names, sizes, mtimes; chain links when headers=True)."""
    s = Scan(root=str(root))
    for e in _files(os.path.join(root, "pages")):
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        name = parse_page_name(e.name)
        if name is None or not e.is_file(follow_symlinks=False):
            s.strays.append((e.name, st.st_size))
            continue
        ent = PageEntry(name, e.path, st.st_size, st.st_mtime)
        if headers:
            try:
                m = read_header_only(e.path).meta
                ent.prior, ent.depth = m.get("prior"), int(m.get("depth", -1))
            except (OSError, HeaderError, ValueError) as ex:
                ent.header_error = getattr(ex, "reason", type(ex).__name__)
        s.pages.append(ent)
    for sub, out in (("quarantine", s.quarantine), ("tmp", s.tmp)):
        for e in _files(os.path.join(root, sub)):
            try:
                out.append((e.name, e.stat(follow_symlinks=False).st_size))
            except OSError:
                pass
    for e in _files(os.path.join(root, "models")):
        if e.name.endswith(".json"):
            try:
                with open(e.path) as f:
                    m = json.load(f)
                s.models[m["mid"]] = m.get("identity", {})
            except (OSError, ValueError, KeyError):
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
            cur: Optional[str] = m
            while cur and cur in kv and cur not in covered:
                covered.add(cur)
                cur = kv[cur].prior
        r = out.setdefault(mid, {"kv_bytes": 0, "covered_bytes": 0, "kv_pages": 0, "covered_pages": 0,
                                 "unknown_links": 0})
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
        m = models.setdefault(p.name.mid, {
            "mid": p.name.mid,
            "model": s.models.get(p.name.mid, {}).get("model", "?"),
            "pools": {}, "shards": set(), "pages": 0, "bytes": 0,
        })
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
        "quarantined": {"files": len(s.quarantine), "bytes": sum(b for _, b in s.quarantine),
                        "by_reason": reasons},
        "strays": len(s.strays),
        "tmp": len(s.tmp),
    }


def verify_page(path: str) -> Optional[str]:
    """Full re-check of one page file: header, name vs header, every block
    checksum. Returns a reason tag, or None when the page is good."""
    name = parse_page_name(os.path.basename(path))
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(min(size, FIXED + META_MAX + 8 * 4096))
            h = decode_header(head, size)
            m = h.meta
            if name is None or (m.get("key"), m.get("pool"), m.get("pool_digest"), m.get("mid"),
                                m.get("shard")) != (name.key, name.pool, name.pool_digest, name.mid, name.shard):
                return "identity"
            f.seek(h.header_len)
            for i, want in enumerate(h.sums):
                block = f.read(min(BLOCK_BYTES, h.payload_len - i * BLOCK_BYTES))
                if block_sum([memoryview(block)]) != want:
                    return "checksum"
    except HeaderError as e:
        return e.reason
    except FileNotFoundError:
        return None  # evicted meanwhile
    except OSError as e:
        return f"io_error:{e.errno}"
    return None


def quarantine_file(root: str, path: str, reason: str) -> bool:
    dest = os.path.join(root, "quarantine", f"{time.time_ns()}-{reason}-{os.path.basename(path)}")
    try:
        os.rename(path, dest)
        return True
    except OSError:
        return False


def verify(root: str, *, quarantine: bool = True,
           progress: Optional[Callable[[int, int, int], None]] = None) -> dict:
    s = scan(root)
    total_bytes = sum(p.size for p in s.pages)
    bad: list[tuple[str, str]] = []
    done_bytes = 0
    for i, p in enumerate(sorted(s.pages, key=lambda p: p.path)):
        reason = verify_page(p.path)
        if reason is not None:
            bad.append((os.path.basename(p.path), reason))
            if quarantine:
                quarantine_file(root, p.path, reason)
        done_bytes += p.size
        if progress is not None:
            progress(i + 1, len(s.pages), done_bytes)
    for name, _ in s.strays:
        bad.append((name, "stray"))
        if quarantine:
            quarantine_file(root, os.path.join(root, "pages", name), "stray")
    return {"checked": len(s.pages), "bytes": total_bytes, "bad": bad, "quarantined": quarantine}


def evict_to(root: str, target_bytes: int) -> dict:
    """Shrink pages + quarantine to target_bytes: quarantine first, then pages
    least recently used first (mtime; reads refresh it)."""
    s = scan(root)
    total = sum(p.size for p in s.pages) + sum(b for _, b in s.quarantine)
    removed = freed = 0
    victims = [(0.0, os.path.join(root, "quarantine", n), b) for n, b in sorted(s.quarantine)]
    victims += sorted((p.mtime, p.path, p.size) for p in s.pages)
    for _, path, size in victims:
        if total <= target_bytes:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            continue
        total -= size
        freed += size
        removed += 1
    return {"removed": removed, "freed_bytes": freed, "now_bytes": total}


def match_model(s: Scan, model: str) -> set[str]:
    mids = {p.name.mid for p in s.pages} | set(s.models)
    return {m for m in mids if (len(model) >= 4 and m.startswith(model))
            or s.models.get(m, {}).get("model") == model}


def clear(root: str, model: Optional[str] = None) -> dict:
    s = scan(root)
    mids = match_model(s, model) if model else None
    removed = freed = 0
    for p in s.pages:
        if mids is not None and p.name.mid not in mids:
            continue
        try:
            os.unlink(p.path)
            removed += 1
            freed += p.size
        except OSError:
            pass
    if model is None:
        for n, b in s.quarantine:
            try:
                os.unlink(os.path.join(root, "quarantine", n))
                freed += b
            except OSError:
                pass
    return {"removed": removed, "freed_bytes": freed, "models": sorted(mids) if mids is not None else "all"}
