"""PageStore: the torch-free core of the L3 store (names, IO, checks, budget).

The HiCacheStorage adapter (backend.py) turns host-pool pages into memoryview
runs and calls `exists` / `read` / `write` here. Every failure is a result,
never an exception: a bad page is a miss, counted and moved to quarantine/.

A page write that fails with an IO error (EFBIG, EIO, EROFS, a vanished tmp/ ...)
is counted (`write_errors`), logged once per cause until a write succeeds again,
and retried: its bytes are copied aside (the host staging it came from is freed
when the write returns) and written again by a background thread after
RETRY_FIRST_S, then with the delay doubling up to RETRY_MAX_S, for RETRY_FOR_S
(`write_retries`, `write_retried_ok`). What does not fit RETRY_MAX_BYTES, is still
failing after RETRY_FOR_S or is pending when the store closes is dropped
(`write_retry_dropped`). A full disk (`write_enospc`) and the byte cap
(`write_dropped_budget`) drop the page as before. Upstream's buffer-only pipeline
believes every acknowledged write stored, failed or not (its TP-identical
existence beliefs), and never writes those pages again while it does, so the
retry is what brings the pages of a finished request to L3 once the fault ends.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import stat
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from sglang_l3 import metrics
from sglang_l3.storage import writers
from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.evictor import fs_usage, make_evictor
from sglang_l3.storage.format import (
    CHECKSUM_NAME,
    PAGE_SUFFIX,
    Header,
    PageName,
    file_len_for,
    parse_page_name,
)
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard, diff
from sglang_l3.storage.io_engine import IOEngine, ReadJob, WriteJob
from sglang_l3.storage.retention import open_retention
from sglang_l3.storage.safety import StoreDirs, valid_key, valid_mid, valid_pool

logger = logging.getLogger(__name__)

_STRAY_MIN_AGE_S = 60

# Failed page writes kept for a retry (module docstring; docs/operations.md).
RETRY_MAX_BYTES = 256 << 20  # bytes of failed pages held for a retry, per store (rank)
RETRY_FIRST_S = 1.0  # the first retry, after the failure
RETRY_MAX_S = 30.0  # the longest wait between two tries of a page
RETRY_FOR_S = 600.0  # a page still failing this long after its first failure is dropped
_RETRYABLE = frozenset({"io_error", "missing"})


@dataclass
class _Retry:
    item: WriteItem
    nbytes: int
    first: float  # time.monotonic() of the first failure
    due: float
    delay: float


@dataclass(frozen=True)
class PoolSpec:
    layout: PoolLayout
    digest: str
    replicated: bool  # TP-replicated (MLA KV): one file shared by all TP ranks
    payload_len: int
    file_len: int


@dataclass
class WriteItem:
    key: str
    spec: PoolSpec
    runs: Sequence[memoryview]
    prior: str | None = None  # previous page key in the hash chain ("" = first page)
    depth: int = -1  # page index from the sequence start (-1 = unknown)


@dataclass
class ReadItem:
    key: str
    spec: PoolSpec
    runs: Sequence[memoryview]


class PageStore:
    def __init__(
        self,
        settings: StoreSettings,
        model: ModelIdentity,
        shard: Shard,
        *,
        replicated_writer: bool = True,
        sweep_strays: bool | None = None,
    ):
        self.settings = settings
        self.model = model
        self.shard = shard
        self.mid = model.digest()
        if not valid_mid(self.mid):
            raise ValueError(f"invalid model identity digest {self.mid!r}")
        # Opened and checked once; pages/tmp/quarantine IO is relative to these descriptors.
        self.dirs = StoreDirs(settings.root)
        self.root = self.dirs.root
        self.pages_dir = str(self.root / "pages")
        self.tmp_dir = str(self.root / "tmp")
        self.quarantine_dir = str(self.root / "quarantine")
        self.counters = metrics.Counters()
        self._qlock = threading.Lock()
        # one writer at a time: the caller's batch or the retry thread's
        self._write_lock = threading.Lock()
        self._retry_lock = threading.Lock()
        self._retry: dict[str, _Retry] = {}  # page stem -> a failed page waiting for its next try
        self._retry_bytes = 0
        self._retry_wake = threading.Event()
        self._retry_thread: threading.Thread | None = None
        self._closing = False
        self._failing: dict[str, int] = {}  # cause -> failures since a write last succeeded (logged once)
        self.retry_first_s, self.retry_max_s, self.retry_for_s = RETRY_FIRST_S, RETRY_MAX_S, RETRY_FOR_S
        self.retry_max_bytes = RETRY_MAX_BYTES
        self._static_meta: dict[tuple[str, str], dict] = {}
        try:
            writers.hold_writer_lock(self.dirs)
        except OSError as e:  # e.g. no flock on this filesystem: liveness falls back to the pid check
            logger.warning("sglang-l3 store: cannot take the writer lock in %s: %s", self.dirs.path("locks"), e)
        self._cleanup_tmp()
        self._write_manifest()
        self.odirect = self._probe_odirect(settings.odirect)
        self.engine = IOEngine(
            threads=settings.io_threads,
            odirect=self.odirect,
            durability=settings.durability,
            tmp_dir=self.tmp_dir,
            pages_dir=self.pages_dir,
            dirs=self.dirs,
        )
        self.own_suffix = f".{self.mid}.{shard.name()}"
        self.shared_suffix = f".{self.mid}.{shard.name(replicated=True)}"
        self._replicated_writer = replicated_writer
        owned = (self.own_suffix,) + ((self.shared_suffix,) if replicated_writer else ())
        total, _ = fs_usage(self.pages_dir)
        n_writers = max(1, shard.tp_size * shard.pp_size * shard.cp_size)
        self.max_bytes_rank = settings.max_bytes // n_writers if settings.max_bytes else 0
        self.min_free_bytes = settings.min_free_bytes(total)
        self.sessions = open_retention(self.dirs, self.mid, shard)  # issue 13: session retention
        self.evictor = make_evictor(
            self.pages_dir,
            owned_suffixes=owned,
            tp_rank=shard.tp_rank,
            max_bytes=self.max_bytes_rank,
            min_free_bytes=self.min_free_bytes,
            eviction_ratio=settings.eviction_ratio,
            on_evict=lambda _stem: self.counters.inc("evicted"),
            retention=self.sessions,
            counters=self.counters,
        )
        if sweep_strays is None:
            sweep_strays = shard.tp_rank == 0 and shard.pp_rank == 0 and shard.cp_rank == 0
        self._sweeper: threading.Thread | None = None
        if sweep_strays:
            self._sweeper = threading.Thread(target=self._sweep_strays, name="sglang-l3-sweep", daemon=True)
            self._sweeper.start()
        logger.info(
            "sglang-l3 store at %s (model %s, shard %s): odirect=%s durability=%s threads=%d cap/rank=%s min_free=%s",
            self.root,
            self.mid,
            shard.name(),
            self.odirect,
            settings.durability,
            settings.io_threads,
            self.max_bytes_rank or "none",
            self.min_free_bytes,
        )

    # ------------------------------------------------------------- start-up
    def _cleanup_tmp(self) -> None:
        """Leftovers of writers that died (kill -9, crash); a live writer's
        (another rank's, another server's) are kept (writers.sweep_tmp)."""
        try:
            n, _ = writers.sweep_tmp(self.dirs)
        except OSError as e:
            logger.warning("sglang-l3 store: tmp cleanup failed: %s", e)
            return
        if n:
            self.counters.inc("tmp_cleaned", n)

    def _write_manifest(self) -> None:
        name = f"{self.mid}.json"
        body = json.dumps({"mid": self.mid, "identity": self.model.as_dict()}, sort_keys=True, indent=1).encode()
        try:
            if self.dirs.read_file("models", name) == body:
                return
            self.dirs.replace_file("models", name, body)
        except OSError as e:  # informational only (CLI names models with it)
            logger.warning("sglang-l3 store: cannot write model manifest %s: %s", self.dirs.path("models", name), e)

    def _probe_odirect(self, mode: str) -> bool:
        if mode == "off" or not hasattr(os, "O_DIRECT"):
            return False
        probe = f"{os.getpid()}-odirect-probe.tmp"
        try:
            fd = self.dirs.open_file("tmp", probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
            os.close(fd)
            return True
        except OSError as e:
            if mode == "on":
                logger.warning("sglang-l3 store: odirect=on but %s refuses O_DIRECT (%s)", self.root, e)
            return False
        finally:
            self.dirs.remove("tmp", probe)

    def _sweep_strays(self) -> None:
        """Files in pages/ that are not pages (and not fresh) go to quarantine,
        and so does anything at a page's name that is not a regular file of ours."""
        try:
            now = time.time()
            for name in os.listdir(self.dirs.fd("pages")):
                kind, st = self.dirs.classify("pages", name)
                if st is None:
                    continue
                if parse_page_name(name) is not None:
                    if kind != "file":
                        self.quarantine(os.path.join(self.pages_dir, name), kind, (st.st_dev, st.st_ino))
                    continue
                if now - st.st_mtime >= _STRAY_MIN_AGE_S:
                    self.quarantine(os.path.join(self.pages_dir, name), "stray", (st.st_dev, st.st_ino))
        except Exception as ex:  # background hygiene; never fatal
            logger.warning("sglang-l3 store: stray sweep failed: %s", ex)

    # ---------------------------------------------------------------- names
    def pool_spec(self, layout: PoolLayout, *, replicated: bool = False) -> PoolSpec:
        if not valid_pool(layout.pool):
            raise ValueError(f"invalid pool name {layout.pool!r}")
        if layout.payload_bytes <= 0:
            raise ValueError(f"pool {layout.pool!r} has an empty page")
        return PoolSpec(layout, layout.digest(), replicated, layout.payload_bytes, file_len_for(layout.payload_bytes))

    def page_name(self, key: str, spec: PoolSpec) -> PageName:
        return PageName(key, spec.layout.pool, spec.digest, self.mid, self.shard.name(replicated=spec.replicated))

    def path_of(self, key: str, spec: PoolSpec) -> str:
        return os.path.join(self.pages_dir, self.page_name(key, spec).filename)

    def _owned(self, spec: PoolSpec) -> bool:
        return not spec.replicated or self._replicated_writer

    # --------------------------------------------------------------- exists
    def exists(self, items: Sequence[tuple[str, PoolSpec]]) -> list[bool]:
        """Present with the exact size a valid page has. A wrong-size file is
        quarantined here, so the hit count never promises an unreadable page."""
        out = []
        for key, spec in items:
            if not valid_key(key):
                self.counters.inc("invalid_keys")
                out.append(False)
                continue
            name = self.page_name(key, spec).filename
            try:  # lstat relative to the opened pages/: a link is damage, never followed
                kind, st = self.dirs.classify("pages", name)
            except OSError:
                out.append(False)
                continue
            if st is None:
                out.append(False)
                continue
            if kind != "file" or st.st_size != spec.file_len:
                self.quarantine(
                    os.path.join(self.pages_dir, name), "size" if kind == "file" else kind, (st.st_dev, st.st_ino)
                )
                out.append(False)
                continue
            out.append(True)
        self.counters.inc("exists_queries", len(items))
        self.counters.inc("exists_hits", sum(out))
        return out

    # ----------------------------------------------------------------- read
    def _checker(self, key: str, spec: PoolSpec, name: PageName):
        def check(h: Header) -> str | None:
            m = h.meta
            if m.get("key") != key or m.get("pool") != spec.layout.pool:
                return f"page is {m.get('key')!r}/{m.get('pool')!r}, wanted {key!r}/{spec.layout.pool!r}"
            if m.get("mid") != self.mid:
                d = diff(self.model.as_dict(), m.get("model") or {})
                return "another model identity: " + ("; ".join(d[:4]) or m.get("mid", "?"))
            if m.get("shard") != name.shard:
                return f"shard {m.get('shard')!r}, wanted {name.shard!r}"
            if m.get("pool_digest") != spec.digest:
                d = diff(spec.layout.as_dict(), m.get("pool_layout") or {})
                return "another page layout: " + ("; ".join(d[:4]) or m.get("pool_digest", "?"))
            return None

        return check

    def read(self, items: Sequence[ReadItem]) -> list[bool]:
        out = [False] * len(items)
        jobs, where = [], []
        for i, it in enumerate(items):
            if not valid_key(it.key):
                self.counters.inc("invalid_keys")
                continue
            name = self.page_name(it.key, it.spec)
            path = os.path.join(self.pages_dir, name.filename)
            jobs.append(ReadJob(path, it.runs, it.spec.payload_len, self._checker(it.key, it.spec, name)))
            where.append((i, name))
        t0 = time.perf_counter()
        results = self.engine.read(jobs) if jobs else []
        self.counters.inc("read_seconds", time.perf_counter() - t0)
        # counted once per batch: an increment takes two locks and may publish, and a
        # restore reads thousands of pages
        counts: Counter[str] = Counter()
        for (i, name), job, r in zip(where, jobs, results, strict=True):
            counts["read_pages"] += 1
            if r.ok:
                out[i] = True
                counts["read_hits"] += 1
                counts["read_bytes"] += job.payload_len
                counts["read_direct"] += r.direct
                counts["read_bounce"] += r.bounce
                if self.evictor is not None and self._owned(items[i].spec):
                    self.evictor.touch(name.stem, job.path)
            elif r.corrupt:
                logger.warning(
                    "sglang-l3 store: page %s is unusable (%s: %s); treated as a miss",
                    name.filename,
                    r.status,
                    r.detail,
                )
                self.quarantine(job.path, r.status, r.file_id)
            elif r.status == "missing":
                counts["read_missing"] += 1
            else:
                counts["read_errors"] += 1
                logger.warning("sglang-l3 store: read of %s failed: %s", name.filename, r.detail)
        self.counters.add(counts)
        return out

    # ---------------------------------------------------------------- write
    def write(self, items: Sequence[WriteItem]) -> list[bool]:
        """Write pages; True per page now in the store. A page that failed with an
        IO error is retried in the background (module docstring)."""
        with self._write_lock:
            status = self._write(items)
        for it, st in zip(items, status, strict=True):
            if st in _RETRYABLE:
                self._queue_retry(it)
        return [st == "ok" for st in status]

    def _write(self, items: Sequence[WriteItem]) -> list[str]:
        """One engine call; per item "ok" or why not (an IOResult status, "invalid")."""
        out = ["invalid"] * len(items)
        jobs, where = [], []
        first_of: dict[str, int] = {}
        dup: list[tuple[int, int]] = []
        for i, it in enumerate(items):
            if not valid_key(it.key):
                self.counters.inc("invalid_keys")
                continue
            name = self.page_name(it.key, it.spec)
            if name.stem in first_of:
                dup.append((i, first_of[name.stem]))
                continue
            first_of[name.stem] = i
            path = os.path.join(self.pages_dir, name.filename)
            if self.exists([(it.key, it.spec)])[0]:
                # Same key = same tokens = same bytes; refresh recency only.
                out[i] = "ok"
                self.counters.inc("write_skipped_existing")
                if self.evictor is not None and self._owned(it.spec):
                    self.evictor.touch(name.stem, path)
                continue
            owner = self.evictor if self.evictor is not None and self._owned(it.spec) else None
            admit = None
            if owner is not None:
                admit = functools.partial(owner.reserve, name.stem, it.spec.file_len, key=it.key)
            meta = dict(
                self._page_meta(it.spec, name.shard),
                key=it.key,
                prior=it.prior,
                depth=it.depth,
                created=round(time.time(), 3),
            )
            jobs.append(WriteJob(path, it.runs, it.spec.payload_len, meta, admit))
            where.append((i, name, owner))
        t0 = time.perf_counter()
        results = self.engine.write(jobs) if jobs else []
        self.counters.inc("write_seconds", time.perf_counter() - t0)
        counts: Counter[str] = Counter()  # once per batch, as in read()
        for (i, name, owner), job, r in zip(where, jobs, results, strict=True):
            counts["write_pages"] += 1
            out[i] = "ok" if r.ok else r.status
            if r.ok:
                counts["write_ok"] += 1
                counts["write_bytes"] += job.payload_len
                counts["write_direct"] += r.direct
                counts["write_bounce"] += r.bounce
                if owner is not None:
                    owner.commit(name.stem)
                continue
            if r.status == "budget":  # refused before anything was reserved
                counts["write_dropped_budget"] += 1
                continue
            if owner is not None:
                owner.abort(name.stem)
            if r.status == "enospc":
                counts["write_enospc"] += 1
                self._write_failed("enospc", name.filename, r.detail, "disk full; the page is dropped")
            else:
                counts["write_errors"] += 1
                code = errno.errorcode.get(r.errno, str(r.errno)) if r.errno is not None else r.detail.split(":", 1)[0]
                cause = f"{r.status} {code}"
                what = "retried" if r.status in _RETRYABLE else "not retried"
                self._write_failed(cause, name.filename, r.detail, f"the page is {what}")
        self.counters.add(counts)
        if any(st == "ok" for st in out):
            self._writes_succeed()
        for i, j in dup:
            out[i] = out[j] if out[j] == "ok" else "duplicate"
        return out

    def _write_failed(self, cause: str, filename: str, detail: str, outcome: str) -> None:
        """Log a failed page write once per cause until a write succeeds again."""
        with self._retry_lock:
            n = self._failing.get(cause, 0)
            self._failing[cause] = n + 1
        if n == 0:
            logger.warning(
                "sglang-l3 store: write of %s failed: %s; %s. Further page writes failing this way are "
                "counted (store_write_errors / store_write_enospc), not logged, until a write succeeds",
                filename,
                detail,
                outcome,
            )

    def _writes_succeed(self) -> None:
        with self._retry_lock:
            failing, self._failing = self._failing, {}
        if failing:
            logger.warning(
                "sglang-l3 store: page writes succeed again (failed since the first report: %s)",
                ", ".join(f"{n} x {cause}" for cause, n in sorted(failing.items())),
            )

    # ---------------------------------------------------------------- retry
    def _queue_retry(self, item: WriteItem) -> None:
        """Copy a failed page aside (the caller's buffer is freed after the call)
        and hand it to the retry thread; over the byte budget it is dropped."""
        stem = self.page_name(item.key, item.spec).stem
        nbytes = item.spec.payload_len
        with self._retry_lock:
            if stem in self._retry or self._closing:
                return
            if self._retry_bytes + nbytes > self.retry_max_bytes:
                full = True
            else:
                full = False
                self._retry_bytes += nbytes
        if full:
            self.counters.inc("write_retry_dropped")
            self._write_failed("retry-budget", stem, f"{self.retry_max_bytes} bytes of failed pages held", "dropped")
            return
        data = bytearray(nbytes)
        off = 0
        for r in item.runs:
            data[off : off + r.nbytes] = r  # byte views (pagemap); any contiguous buffer works
            off += r.nbytes
        copy = WriteItem(item.key, item.spec, [memoryview(data)], item.prior, item.depth)
        now = time.monotonic()
        with self._retry_lock:
            self._retry[stem] = _Retry(copy, nbytes, now, now + self.retry_first_s, self.retry_first_s)
            if self._retry_thread is None:
                self._retry_thread = threading.Thread(target=self._retry_loop, name="sglang-l3-retry", daemon=True)
                self._retry_thread.start()
        self._retry_wake.set()

    def retry_pending(self) -> int:
        """Failed pages waiting for their next try."""
        with self._retry_lock:
            return len(self._retry)

    def _retry_loop(self) -> None:
        while True:
            self._retry_wake.clear()
            now = time.monotonic()
            with self._retry_lock:
                if self._closing:
                    return
                due = [(stem, e) for stem, e in self._retry.items() if e.due <= now]
                nxt = min((e.due for e in self._retry.values()), default=None)
            if not due:
                self._retry_wake.wait(None if nxt is None else max(0.0, nxt - now))
                continue
            try:
                with self._write_lock:
                    status = self._write([e.item for _, e in due])
            except Exception:  # never let the thread die: try again later
                logger.exception("sglang-l3 store: retrying failed page writes failed")
                status = ["io_error"] * len(due)
            now = time.monotonic()
            with self._retry_lock:
                for (stem, e), st in zip(due, status, strict=True):
                    self.counters.inc("write_retries")
                    if st == "ok":
                        self.counters.inc("write_retried_ok")
                    elif st in _RETRYABLE and now - e.first < self.retry_for_s:
                        e.delay = min(e.delay * 2, self.retry_max_s)
                        e.due = now + e.delay
                        continue
                    else:  # gave up, or dropped by the cap / a full disk (counted as such)
                        self.counters.inc("write_retry_dropped")
                    del self._retry[stem]
                    self._retry_bytes -= e.nbytes

    def _page_meta(self, spec: PoolSpec, shard: str) -> dict:
        """The header fields shared by every page of a pool (built once: the
        identity dicts cost more per page than the IO bookkeeping)."""
        m = self._static_meta.get((spec.digest, shard))
        if m is None:
            m = {
                "pool": spec.layout.pool,
                "mid": self.mid,
                "shard": shard,
                "pool_digest": spec.digest,
                "model": self.model.as_dict(),
                "pool_layout": spec.layout.as_dict(),
                "checksum": CHECKSUM_NAME,
            }
            self._static_meta[(spec.digest, shard)] = m
        return m

    # ----------------------------------------------------------- quarantine
    def quarantine(self, path: str, reason: str, file_id: tuple[int, int] | None = None) -> bool:
        """Move a bad file aside (kept for inspection, bounded in size)."""
        # Relative to the opened pages/ and quarantine/, by name: a link is moved
        # (or removed) itself, its target is never touched.
        base = os.path.basename(path)
        pfd, qfd = self.dirs.fd("pages"), self.dirs.fd("quarantine")
        try:
            st = os.stat(base, dir_fd=pfd, follow_symlinks=False)
            if file_id is not None and (st.st_dev, st.st_ino) != file_id:
                return False  # replaced by a fresh write since we looked
            os.rename(base, f"{time.time_ns()}-{reason}-{base}", src_dir_fd=pfd, dst_dir_fd=qfd)
        except FileNotFoundError:
            return False
        except OSError as e:
            logger.warning("sglang-l3 store: cannot quarantine %s: %s; removing it", path, e)
            try:
                if stat.S_ISDIR(os.stat(base, dir_fd=pfd, follow_symlinks=False).st_mode):
                    shutil.rmtree(base, dir_fd=pfd)
                else:
                    os.unlink(base, dir_fd=pfd)
            except OSError:
                return False
        self.counters.inc("quarantined")
        self.counters.inc(f"quarantined_{reason}")
        parsed = parse_page_name(base)
        if parsed is not None and self.evictor is not None:
            self.evictor.abort(parsed.stem)  # forget it: not ours to count any more
        self._bound_quarantine()
        return True

    def _bound_quarantine(self) -> None:
        with self._qlock:
            try:
                qfd = self.dirs.fd("quarantine")
                entries = []
                for name in os.listdir(qfd):
                    try:
                        st = os.stat(name, dir_fd=qfd, follow_symlinks=False)
                    except OSError:
                        continue
                    entries.append((name, st.st_size if stat.S_ISREG(st.st_mode) else 0, stat.S_ISDIR(st.st_mode)))
                entries.sort()  # names start with a timestamp: oldest first
                total = sum(s for _, s, _ in entries)
                for name, size, is_dir in entries:
                    if total <= self.settings.quarantine_max_bytes:
                        break
                    if is_dir:
                        continue  # a directory planted at a page name: no bytes of ours to bound
                    os.unlink(name, dir_fd=qfd)
                    total -= size
            except OSError as e:
                logger.warning("sglang-l3 store: quarantine trim failed: %s", e)

    # ---------------------------------------------------------------- admin
    def clear_own(self) -> int:
        """Remove this rank's pages (and the shared ones if it writes them)."""
        n = 0
        suffixes = (self.own_suffix + PAGE_SUFFIX,) + (
            (self.shared_suffix + PAGE_SUFFIX,) if self._replicated_writer else ()
        )
        with os.scandir(self.pages_dir) as it:
            for e in it:
                if e.name.endswith(suffixes):
                    try:
                        os.unlink(e.path)
                        n += 1
                    except OSError:
                        pass
        if self.evictor is not None:
            self.evictor.clear()
        return n

    def close(self) -> None:
        self.sessions.close_registry()
        with self._retry_lock:
            self._closing = True
            thread, left = self._retry_thread, len(self._retry)
            self._retry.clear()
            self._retry_bytes = 0
        self._retry_wake.set()
        if thread is not None:
            thread.join(timeout=60)
        if left:
            self.counters.inc("write_retry_dropped", left)
            logger.warning("sglang-l3 store: closing with %d failed page write(s) not retried; dropped", left)
        self.engine.close()
        if self._sweeper is not None:
            self._sweeper.join(timeout=60)
            if self._sweeper.is_alive():
                return  # keep the descriptors: the sweep still uses them
        writers.release_writer_lock(self.dirs)
        self.dirs.close()


__all__ = ["PageStore", "PoolSpec", "ReadItem", "WriteItem"]
