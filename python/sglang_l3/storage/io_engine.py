"""Parallel, vectored page IO straight between host buffers and files.

Upstream's file backend reads/writes one page at a time on one thread through
a temporary tensor (HiCacheFile.batch_get / batch_set). Here a batch of pages is cut
into 4 MiB checksum blocks; workers (the calling thread plus pool threads)
pull blocks off one shared list and run one `preadv`/`pwritev` per block
directly on the caller's memoryviews (the host pool's own memory), so the disk
sees many requests in flight and no byte is copied in user space. Checksums
are computed per block in the same worker (xxhash releases the GIL); buffered
reads are hashed piece by piece right after each piece lands, while it is
still in the CPU cache.

CPU cost (benchmark/storage_bench.py --tmpfs): a buffered copy is CPU work, so
a batch without O_DIRECT runs on at most one worker per CPU - more threads only
preempt each other mid-copy and evict each other's blocks from the cache;
O_DIRECT batches use all `io_threads` (queue depth for the device).

Writes: tmp file (O_EXCL, 0600) -> fallocate -> payload blocks -> header ->
[fdatasync] -> rename; with durability=batch the pages directory is fsynced
once after the batch's renames. A crash leaves at most a tmp file; a page
whose data never reached the disk fails its checksum and is a miss.

Torch- and sglang-free.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sglang_l3.storage.format import (
    ALIGN,
    BLOCK_BYTES,
    Header,
    HeaderError,
    align_up,
    block_hasher,
    block_sum,
    decode_header,
    encode_header,
    header_len_for,
    n_blocks_for,
)
from sglang_l3.storage.safety import StoreDirs, UnsafeFileError, open_file

logger = logging.getLogger(__name__)

_IOV_MAX = 512
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_ENOSPC = {errno.ENOSPC, errno.EDQUOT}
_TOUCH_AFTER_S = 60.0
# Buffered reads land piece by piece and each piece is hashed while it is in
# the CPU cache (L2 is 1-2 MiB per core); the block's checksum is unchanged.
_READ_PIECE = 512 << 10


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass
class WriteJob:
    final_path: str
    runs: Sequence[memoryview]
    payload_len: int
    meta: dict
    # Budget gate, called right before this page's space is allocated, so a
    # free-space check sees the pages allocated before it in the batch.
    admit: Callable[[], bool] | None = None


@dataclass
class ReadJob:
    path: str
    runs: Sequence[memoryview]
    payload_len: int
    # Returns a reason tag when the (self-consistent) header belongs elsewhere.
    check: Callable[[Header], str | None]


@dataclass
class IOResult:
    ok: bool
    status: str = "ok"  # ok | missing | enospc | budget | io_error | <corruption reason>
    detail: str = ""
    corrupt: bool = False
    file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of what was read
    direct: bool = False
    bounce: bool = False
    errno: int | None = None  # of the OSError behind a failure (None: not an OSError)


def buffer_address(mv: memoryview) -> int | None:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    except (TypeError, ValueError):  # read-only or empty
        return None


def aligned(runs: Sequence[memoryview], a: int = ALIGN) -> bool:
    for r in runs:
        addr = buffer_address(r)
        if addr is None or addr % a or r.nbytes % a:
            return False
    return True


def _slice(runs: Sequence[memoryview], cum: list[int], start: int, end: int) -> list[memoryview]:
    out = []
    i = bisect.bisect_right(cum, start) - 1
    while start < end and i < len(runs):
        r0 = cum[i]
        a = start - r0
        b = min(end - r0, runs[i].nbytes)
        out.append(runs[i][a:b])
        start = r0 + b
        i += 1
    return out


def _consume(views: list[memoryview], n: int) -> None:
    """Drop the first n bytes from a vectored-IO list (a short pwritev/preadv)."""
    while n and views:
        if n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def _pwritev_all(fd: int, views: list[memoryview], off: int) -> None:
    views = [v for v in views if v.nbytes]
    while views:
        batch = views[:_IOV_MAX]
        n = os.pwritev(fd, batch, off)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        off += n
        _consume(views, n)


def _preadv_all(fd: int, views: list[memoryview], off: int) -> int:
    views = [v for v in views if v.nbytes]
    total = 0
    while views:
        batch = views[:_IOV_MAX]
        n = os.preadv(fd, batch, off)
        if n <= 0:
            break  # EOF: caller compares with what it expected
        off += n
        total += n
        _consume(views, n)
    return total


_memmove = ctypes.memmove  # a ctypes foreign call: copies without holding the GIL


def _copy_address(mv: memoryview) -> int:
    """buffer_address of a view a bounce copy goes through: a memmove to or from
    NULL (a read-only view) would crash the process, so that is an error."""
    addr = buffer_address(mv)
    if addr is None:
        raise ValueError(f"cannot copy through a read-only buffer ({mv.nbytes} bytes)")
    return addr


def _gather(dst: memoryview, views: list[memoryview]) -> None:
    base, off = _copy_address(dst), 0
    for v in views:
        if v.nbytes:  # an empty view has no address and nothing to copy
            _memmove(base + off, _copy_address(v), v.nbytes)
            off += v.nbytes


def _scatter(src: memoryview, views: list[memoryview]) -> None:
    base, off = _copy_address(src), 0
    for v in views:
        if v.nbytes:  # an empty view has no address and nothing to copy
            _memmove(_copy_address(v), base + off, v.nbytes)
            off += v.nbytes


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(nbytes, ALIGN))  # anonymous maps are page-aligned


def _read_hashed(p: _Page, i: int, a: int, b: int) -> None:
    """Buffered read of payload block i ([a, b)) in pieces, each hashed while
    it is still in the cache (block 0 brings the header along)."""
    assert p.hdr is not None  # read() gives every page its header view before the tasks run
    h = block_hasher()
    s = a
    while s < b:
        e = min(s + _READ_PIECE, b)
        views = _slice(p.runs, p.cum, s, e)
        got = _preadv_all(p.fd, [p.hdr] + views, 0) - p.hlen if s == 0 else _preadv_all(p.fd, views, p.hlen + s)
        if got != e - s:
            p.short = True
            return
        for v in views:
            h.update(v)
        s = e
    p.sums[i] = h.intdigest()


@dataclass
class _Page:
    index: int
    payload_len: int
    hlen: int
    runs: Sequence[memoryview]
    cum: list[int]
    direct: bool
    bounce: bool = False  # O_DIRECT through an aligned per-thread block (unaligned host memory)
    fd: int = -1
    tmp: str = ""
    remaining: int = 0
    sums: list = field(default_factory=list)
    error: BaseException | None = None
    hdr: memoryview | None = None
    st_size: int = 0
    file_id: tuple[int, int] | None = None
    st_mtime: float = 0.0
    short: bool = False
    header_written: bool = False


class IOEngine:
    def __init__(
        self,
        *,
        threads: int,
        odirect: bool,
        durability: str,
        tmp_dir: str,
        pages_dir: str,
        dirs: StoreDirs | None = None,
    ):
        self.threads = threads
        self.odirect = bool(odirect and _O_DIRECT)
        self.durability = durability
        self.tmp_dir = tmp_dir
        self.pages_dir = pages_dir
        # Opened, checked tmp/ and pages/: every open, rename and unlink is
        # relative to them and follows no link (safety.open_file).
        self._dir_fds: dict[str, int] = {}
        if dirs is not None:
            self._dir_fds = {os.path.abspath(dirs.path(s)): dirs.fd(s) for s in ("tmp", "pages")}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="sglang-l3-io")
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._cpus = _cpu_count()
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ utils
    def _direct_mode(self, runs: Sequence[memoryview], payload_len: int) -> tuple[bool, bool]:
        """(direct, bounce). O_DIRECT needs 4 KiB-aligned memory, lengths and
        offsets. Aligned host memory (e.g. hipHostMalloc pools) is read/written
        in place; unaligned memory (torch.empty blocks sit 64 bytes off a page)
        goes through an aligned per-thread block: one memcpy, the same count as
        the page cache would make, without its readahead and double caching."""
        if not self.odirect or payload_len % ALIGN:
            return False, False
        return True, not aligned(runs)

    def _bounce(self) -> memoryview:
        mv = getattr(self._tls, "bounce", None)
        if mv is None:
            mv = memoryview(_aligned_buffer(BLOCK_BYTES))
            self._tls.bounce = mv
        return mv

    def _at(self, path: str) -> tuple[int | None, str]:
        """(directory fd, name) for a path in tmp/ or pages/; (None, path) otherwise."""
        head, name = os.path.split(path)
        return self._dir_fds.get(os.path.abspath(head)), name

    def _open_nofollow(self, path: str, flags: int, mode: int) -> int:
        """A regular file of ours, never through a link (UnsafeFileError otherwise)."""
        dfd, name = self._at(path)
        if dfd is not None:
            return open_file(dfd, name, flags, mode)
        head, name = os.path.split(os.path.abspath(path))
        dfd = os.open(head, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return open_file(dfd, name, flags, mode)
        finally:
            os.close(dfd)

    def _rename(self, src: str, dst: str) -> None:
        (sfd, sname), (dfd, dname) = self._at(src), self._at(dst)
        if sfd is not None and dfd is not None:
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)  # replaces a link, never follows it
        else:
            os.rename(src, dst)

    def _unlink(self, path: str) -> None:
        dfd, name = self._at(path)
        if dfd is not None:
            os.unlink(name, dir_fd=dfd)
        else:
            os.unlink(path)

    def _open(self, path: str, flags: int, direct: bool, mode: int = 0o600) -> tuple[int, bool]:
        if direct:
            try:
                return self._open_nofollow(path, flags | _O_DIRECT, mode), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                logger.warning("sglang-l3 store: O_DIRECT unsupported here (%s); using buffered IO", e)
                self.odirect = False
        return self._open_nofollow(path, flags, mode), False

    def _header_arena(self, nbytes: int) -> memoryview:
        """Aligned scratch for this call's headers, reused per calling thread
        (a fresh anonymous map per batch costs page faults and zeroing)."""
        arena = getattr(self._tls, "headers", None)
        if arena is None or arena.nbytes < nbytes:
            arena = memoryview(_aligned_buffer(align_up(nbytes, 1 << 20)))
            self._tls.headers = arena
        return arena[:nbytes]

    def _workers(self, pages: list[_Page]) -> int:
        """Buffered IO is a CPU copy: one worker per CPU. O_DIRECT waits on the
        device: io_threads requests in flight."""
        if any(p.direct for p in pages):
            return self.threads
        return min(self.threads, self._cpus)

    def _run(self, pages: list[_Page], task: Callable[[_Page, int], None], finalize: Callable[[_Page], None]) -> None:
        """Run every block of every page; the last block of a page finalizes it
        in the same worker (so fdatasync/rename run in parallel). Workers take
        blocks off one list (no per-block future or hand-off); the caller is
        one of them, so one worker means no thread switch at all."""
        blocks: list[tuple[_Page, int]] = []
        for page in pages:
            nb = n_blocks_for(page.payload_len)
            page.remaining = nb
            page.sums = [0] * nb
            blocks.extend((page, i) for i in range(nb))
        n_blocks = len(blocks)
        claim = itertools.count().__next__  # atomic under the GIL
        lock = threading.Lock()

        def drain() -> None:
            while True:
                k = claim()
                if k >= n_blocks:
                    return
                page, i = blocks[k]
                try:
                    if page.error is None:
                        task(page, i)
                except BaseException as e:  # recorded, never raised into the caller
                    page.error = page.error or e
                with lock:
                    page.remaining -= 1
                    last = page.remaining == 0
                if last:
                    try:
                        finalize(page)
                    except BaseException:  # finalize records its own result
                        logger.exception("sglang-l3 store: finalizing a page failed")

        helpers = [self._pool.submit(drain) for _ in range(min(self._workers(pages), n_blocks) - 1)]
        drain()
        for f in helpers:
            f.result()

    # ------------------------------------------------------------------ write
    def write(self, jobs: Sequence[WriteJob]) -> list[IOResult]:
        results: list[IOResult | None] = [None] * len(jobs)
        pages: list[_Page] = []
        hbuf = None
        for idx, job in enumerate(jobs):
            hlen = header_len_for(job.payload_len)
            cum = [0]
            for r in job.runs:
                cum.append(cum[-1] + r.nbytes)
            if cum[-1] != job.payload_len:
                results[idx] = IOResult(False, "io_error", f"runs hold {cum[-1]} bytes, expected {job.payload_len}")
                continue
            if job.admit is not None and not job.admit():
                results[idx] = IOResult(False, "budget")
                continue
            direct, bounce = self._direct_mode(job.runs, job.payload_len)
            page = _Page(idx, job.payload_len, hlen, job.runs, cum, direct, bounce)
            page.tmp = os.path.join(self.tmp_dir, f"{os.getpid()}-{uuid.uuid4().hex}.tmp")
            try:
                page.fd, page.direct = self._open(page.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, page.direct)
                page.bounce = page.bounce and page.direct
                try:
                    # Early ENOSPC; the free-space floor sees this page before the next is admitted;
                    # parallel O_DIRECT writes into allocated blocks do not serialize on the inode.
                    os.posix_fallocate(page.fd, 0, hlen + job.payload_len)
                except OSError as e:
                    if e.errno in _ENOSPC:
                        raise
            except OSError as e:
                self._discard(page)
                results[idx] = self._error_result(e)
                continue
            pages.append(page)
        if pages:
            if any(p.direct for p in pages):
                hbuf = self._header_arena(sum(p.hlen for p in pages if p.direct))
            off = 0
            for p in pages:
                if p.direct:
                    assert hbuf is not None  # allocated above for the direct pages
                    p.hdr = hbuf[off : off + p.hlen]
                    off += p.hlen

            def task(p: _Page, i: int) -> None:
                a, b = i * BLOCK_BYTES, min((i + 1) * BLOCK_BYTES, p.payload_len)
                views = _slice(p.runs, p.cum, a, b)
                if p.bounce:
                    blk = self._bounce()[: b - a]
                    _gather(blk, views)
                    views = [blk]
                p.sums[i] = block_sum(views)
                if len(p.sums) == 1:  # one-block page: header + payload in one request
                    _pwritev_all(p.fd, [self._header_view(p, jobs[p.index].meta)] + views, 0)
                    p.header_written = True
                else:
                    _pwritev_all(p.fd, views, p.hlen + a)

            def finalize(p: _Page) -> None:
                job = jobs[p.index]
                try:
                    if p.error is not None:
                        raise p.error
                    if not p.header_written:
                        _pwritev_all(p.fd, [self._header_view(p, job.meta)], 0)
                    if self.durability == "batch":
                        os.fdatasync(p.fd)
                    os.close(p.fd)
                    p.fd = -1
                    self._rename(p.tmp, job.final_path)
                    results[p.index] = IOResult(True, direct=p.direct, bounce=p.bounce)
                except BaseException as e:
                    self._discard(p)
                    results[p.index] = self._error_result(e)
                finally:
                    p.hdr = None

            self._run(pages, task, finalize)
            # finalize gave every page a result; None would read as "not run", as below
            if self.durability == "batch" and any((res := results[p.index]) is not None and res.ok for p in pages):
                try:
                    dfd = self._dir_fds.get(os.path.abspath(self.pages_dir))
                    if dfd is not None:
                        os.fsync(dfd)
                    else:
                        dfd = os.open(self.pages_dir, os.O_RDONLY | os.O_DIRECTORY)
                        try:
                            os.fsync(dfd)
                        finally:
                            os.close(dfd)
                except OSError as e:  # renames happened; only durability is in doubt
                    logger.warning("sglang-l3 store: directory fsync failed: %s", e)
        return [r if r is not None else IOResult(False, "io_error", "not run") for r in results]

    @staticmethod
    def _header_view(p: _Page, meta: dict) -> memoryview:
        header = encode_header(meta, p.payload_len, p.sums)
        if p.hdr is None:
            return memoryview(header)
        p.hdr[:] = header  # aligned buffer for O_DIRECT
        return p.hdr

    def _discard(self, p: _Page) -> None:
        if p.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(p.fd)
            p.fd = -1
        if p.tmp:
            with contextlib.suppress(OSError):
                self._unlink(p.tmp)

    @staticmethod
    def _error_result(e: BaseException) -> IOResult:
        if isinstance(e, UnsafeFileError):  # a link / directory / FIFO / foreign file at the name: damage
            return IOResult(False, e.kind, str(e), corrupt=True)
        code = e.errno if isinstance(e, OSError) else None
        if code in _ENOSPC:
            return IOResult(False, "enospc", str(e), errno=code)
        if isinstance(e, FileNotFoundError):
            return IOResult(False, "missing", str(e), errno=code)
        return IOResult(False, "io_error", f"{type(e).__name__}: {e}", errno=code)

    # ------------------------------------------------------------------- read
    def read(self, jobs: Sequence[ReadJob]) -> list[IOResult]:
        results: list[IOResult | None] = [None] * len(jobs)
        pages: list[_Page] = []
        for idx, job in enumerate(jobs):
            hlen = header_len_for(job.payload_len)
            cum = [0]
            for r in job.runs:
                cum.append(cum[-1] + r.nbytes)
            if cum[-1] != job.payload_len:
                results[idx] = IOResult(False, "io_error", f"runs hold {cum[-1]} bytes, expected {job.payload_len}")
                continue
            direct, bounce = self._direct_mode(job.runs, job.payload_len)
            page = _Page(idx, job.payload_len, hlen, job.runs, cum, direct, bounce)
            try:
                page.fd, page.direct = self._open(job.path, os.O_RDONLY, page.direct)
                page.bounce = page.bounce and page.direct
                st = os.fstat(page.fd)
            except OSError as e:
                self._discard_read(page)
                results[idx] = self._error_result(e)
                continue
            page.st_size, page.st_mtime = st.st_size, st.st_mtime
            page.file_id = (st.st_dev, st.st_ino)
            if st.st_size != hlen + job.payload_len:
                # Truncated, zero-length or foreign: decided without reading.
                self._discard_read(page)
                what = "zero-length" if st.st_size == 0 else f"{st.st_size} bytes"
                results[idx] = IOResult(
                    False, "size", f"{what}, expected {hlen + job.payload_len}", corrupt=True, file_id=page.file_id
                )
                continue
            pages.append(page)
        if not pages:
            return [r if r is not None else IOResult(False, "io_error", "not run") for r in results]
        hbuf = self._header_arena(sum(p.hlen for p in pages))
        off = 0
        for p in pages:
            p.hdr = hbuf[off : off + p.hlen]
            off += p.hlen

        def task(p: _Page, i: int) -> None:
            a, b = i * BLOCK_BYTES, min((i + 1) * BLOCK_BYTES, p.payload_len)
            if not p.direct:
                _read_hashed(p, i, a, b)
                return
            views = _slice(p.runs, p.cum, a, b)
            want = b - a
            dst = [self._bounce()[:want]] if p.bounce else views
            assert p.hdr is not None  # set for every page above; finalize clears it
            got = _preadv_all(p.fd, [p.hdr] + dst, 0) - p.hlen if i == 0 else _preadv_all(p.fd, dst, p.hlen + a)
            if got != want:
                p.short = True
                return
            p.sums[i] = block_sum(dst)
            if p.bounce:
                _scatter(dst[0], views)

        def finalize(p: _Page) -> None:
            job = jobs[p.index]
            try:
                if p.error is not None:
                    raise p.error
                if p.short:
                    raise HeaderError("truncated", "short read")
                assert p.hdr is not None  # cleared only below, after this
                header = decode_header(p.hdr, p.st_size)
                if header.payload_len != p.payload_len:
                    raise HeaderError("geometry", f"payload {header.payload_len} != {p.payload_len}")
                reason = job.check(header)
                if reason:
                    raise HeaderError("identity", reason)
                bad = [i for i, (x, y) in enumerate(zip(header.sums, p.sums, strict=True)) if x != y]
                if bad:
                    raise HeaderError("checksum", f"payload blocks {bad[:4]} do not match")
                if not p.direct:
                    with contextlib.suppress(OSError):  # the bytes now live in host memory; don't keep a second copy
                        os.posix_fadvise(p.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if time.time() - p.st_mtime > _TOUCH_AFTER_S:
                    with contextlib.suppress(OSError):  # recency survives restarts (the evictor seeds LRU from mtime)
                        os.utime(p.fd)
                results[p.index] = IOResult(True, file_id=p.file_id, direct=p.direct, bounce=p.bounce)
            except HeaderError as e:
                results[p.index] = IOResult(False, e.reason, e.detail, corrupt=True, file_id=p.file_id)
            except BaseException as e:
                r = self._error_result(e)
                r.file_id = p.file_id
                results[p.index] = r
            finally:
                p.hdr = None
                self._discard_read(p)

        self._run(pages, task, finalize)
        return [r if r is not None else IOResult(False, "io_error", "not run") for r in results]

    @staticmethod
    def _discard_read(p: _Page) -> None:
        if p.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(p.fd)
            p.fd = -1
