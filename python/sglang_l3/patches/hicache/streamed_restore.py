"""Patch `streamed-restore` (why: patches/series.toml): an L3 hit larger than the
host staging buffer restores in rounds.

How (design R-B of the streamed-staging study, with the rounds driven by a lane of our
own rather than by upstream's prefetch thread):

- The hit of length h starting at J (end of the device prefix) is split into
  |R| = (k-1)·p tokens of private device rows R and a last piece r = h - |R| <= p,
  p = a page-aligned fraction of the host KV pool (SGLANG_L3_STREAM_PIECE, 0.4).
- Rounds 1..k-1 (KV only): reader threads read pieces from the store into host
  slots (`cc.page_get_func`, as upstream's IO thread does) while the scheduler
  thread copies the landed piece host -> R and frees its slots (each tick launches
  the next reads before it queues the landed pieces' copies, so a copy that runs on
  the scheduler thread, as on the CPU stack, overlaps the store's read of the next
  piece); at most two pieces are in flight (read concurrently, landed in order), counted in
  `prefetch_tokens_occupied` so writes yield to them.
  Completion is MIN-reduced across TP ranks at the end of `check_hicache_events`,
  so every rank lands, fails or aborts the same piece at the same tick.
- Meanwhile upstream's operation stays parked (`allocate_and_queue_prefetch`
  returns False, the path upstream uses for a host shortfall; parked ops hold no
  anchor pin) and `check_prefetch_progress` holds the request while
  `--hicache-storage-prefetch-policy` allows: `wait_complete` waits, `timeout` waits
  within upstream's budget for the whole hit, `best_effort` stops at the first poll
  (the stream ends, `l3_stream_restore{stop_*}`, and the request recomputes).
  J stays pinned by our own full pin on the anchor node.
- Round k is upstream's own prefetch, trimmed by |R| (`_trim_buffer_prefetch_full_head`):
  the last piece and the Mamba checkpoint at P through upstream's thread, ack drain
  and `stage_completed_prefetch`. The staged hold is then widened to [J, P).
- At admission, upstream's `_allocate_and_queue_load_back` runs on the last piece
  only (the plan shifted by |R|); its device rows are prefixed by R (the head R is
  freed where the device prefix grew past J), so `init_load_back` publishes
  [J, P) in one insert with the Mamba state, and the re-anchor checks hold.
  `PrefillAdder.add_one_req` is credited the |R| rows it would otherwise charge
  twice (already allocated, yet counted as new tokens of the span).
- A piece some rank cannot read (a damaged page: the store's checksum or size check
  fails and quarantines it): the first unreadable page k is MIN-reduced with the
  completion flags, and the stream is cut at the deepest stored Mamba checkpoint
  c <= k that every rank vouched for at the start (the flags of the device-fit
  collective). The landed prefix is kept as R (at most c-1 pages), the op is
  truncated to c and upstream's final round reads the rest of [R, c) with the state
  at c; `l3_stream_restore{cut_storage_error}`. Without such a checkpoint the
  prefetch is revoked and the request recomputes (`storage_error`); KV beliefs past
  k are healed either way so the recompute's insert rewrites the damaged page.
  A failure in the final round (upstream's own read) is upstream's all-or-nothing
  discard; patch `damage-refetch` re-issues that hit.
- R, the pin and host pieces are freed exactly once on every exit: storage error in
  a piece (cut, or revoked and recomputed),
  abort (upstream retires the op; our tick sees it gone), a staged hold released
  (abort, shrunk, device capacity), or `reset` (pools are cleared wholesale there).
  Until then the pipeline is not idle (`is_idle`), so upstream's scheduler neither
  runs its idle leak check over rows a stream still holds nor sleeps past the tick
  that frees them.
- Busy device rows: when free + evictable device tokens cannot take the whole hit
  but the device pool could (other requests, streams or queued L3 writes hold the
  rest), the op stays parked (holding nothing) and is retried every tick until they
  free: the request could not be admitted before then anyway (admission needs its
  whole remaining prompt on the device), and a hit cut to what fits now would
  recompute the rest. While it waits for rows, upstream's `timeout` budget restarts
  (it is the store read's budget, as on upstream's own staged path, where admission
  defers on device capacity after the read), its own and that of every hit parked
  behind it (upstream retries parked hits in order: they wait for it). Counted once per op in
  `l3_stream_restore{waited_write}` (rows held for queued L3 writes, patch
  write-guard, would make it fit) or `{waited_busy}` (other rows). The rows a chunked
  prefill in progress has yet to allocate are not free for a stream (`chunk_reserve`):
  upstream's admission counted them for that request, which allocates them chunk by
  chunk; a stream that took them stopped the scheduler on `Prefill out of memory`.
- Short device pool: when the hit is larger than the whole device pool, the op is
  cut to the longest part ending at a stored Mamba checkpoint that fits (a hybrid
  prefix is only usable there); the request computes the rest. The fit and the
  per-length restorable flags are MIN-reduced across TP ranks in one collective.
  Counted in `l3_stream_restore{truncated_device}`.
- A hit the stream cannot take (no checkpoint fits, shared host layout, SWA) is left
  to upstream, which declines it; counted in `l3_stream_restore{declined_*}`.
- `start_stream(..., fitting=True)` (patch `stream-fitting-hits`: a hit that fits the
  host buffer, streamed too so its copies overlap its reads): pieces of 1/8 of the hit
  (`FITTING_ROUNDS`, at most p); declines are silent and left to upstream's staged
  path, which takes such a hit; a device that cannot take the whole hit now (free +
  evictable, MIN-reduced) neither waits nor cuts: the verdict is `UPSTREAM` with the
  hit unchanged, and nothing is evicted for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import msgspec
import torch

from sglang_l3 import metrics
from sglang_l3.device_reads import host_copy
from sglang_l3.patches.framework import PatchContext
from sglang_l3.patches.hicache import write_guard

logger = logging.getLogger("sglang_l3.streamed_restore")

PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"
URC = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
ADDER = "sglang.srt.managers.schedule_policy:PrefillAdder"
SCHED = "sglang.srt.managers.scheduler:Scheduler"
ENV_PIECE = "SGLANG_L3_STREAM_PIECE"  # fraction of the host KV pool per piece
DEFAULT_PIECE_FRACTION = 0.4
MAX_INFLIGHT = 2  # pieces per stream: read piece i+1 while piece i is copied
READ_BATCH_PAGES = 128  # pages per store call (upstream's STORAGE_BATCH_SIZE)
# A hit that fits the host buffer streams in pieces of 1/8 of it (the prototype's), at
# most a regular piece (start_stream(fitting=True); 0: regular pieces, three rounds at a
# 1.2x buffer, whose two reads run side by side with little copy left to overlap them).
# restore_bench's 1.2 row, quiet box, 2026-12-05 (docs/state-budget.md): restore/store
# 0.70 on upstream's staged path, 0.84 with 1/8 pieces, 0.68 with regular ones at 32K;
# 0.71 -> 0.88 at 131K (issue 50 item 3).
FITTING_ROUNDS = 8


@dataclasses.dataclass
class _Piece:
    first_page: int  # within R
    pages: int
    host: torch.Tensor
    future: Future
    copied: Any = None  # the event recorded after its host -> R copy (queued on the load stream)


@dataclasses.dataclass
class _Retiring:
    """A copy still in flight whose buffers outlive their stream: the host slots (and
    device rows, when the stream no longer uses them) are freed once the copy completed."""

    copied: Any
    host: torch.Tensor | None
    rows: torch.Tensor | None


@dataclasses.dataclass
class Stream:
    handle: Any
    op: Any
    start: int  # J: absolute token position where the hit begins
    hit: int  # h: tokens from J to the hit end P
    rows: torch.Tensor  # R: private device rows for [J, J + |R|)
    rows_host: torch.Tensor | None  # R's indices on host (io backend direct): no piece reads the device
    keys: list[str]  # page hashes of R
    prefix_keys: list[str] | None
    piece_pages: int
    pin: Any = None
    state: str = "reading"  # reading -> ready -> final -> staged; or aborting
    next_page: int = 0
    landed_pages: int = 0  # pages whose host -> R copy is queued
    pieces: deque = dataclasses.field(default_factory=deque)  # reading, in order
    copying: deque = dataclasses.field(default_factory=deque)  # copy queued, host slots held
    reason: str = ""
    flags: list[int] = dataclasses.field(default_factory=list)  # rank-agreed restorable lengths (pages)
    spare: torch.Tensor | None = None  # rows given up by a cut, freed with the stream
    f: tuple | None = None  # (matched_len, num_tokens, hash_values) of the last piece's staged hold
    final_waited: bool = False  # upstream parked the final round for host capacity at least once

    @property
    def r_tokens(self) -> int:
        return len(self.rows)


class Lane:
    """Per-pipeline stream state; only the scheduler thread touches it (the reader
    thread only fills host slots and completes futures)."""

    def __init__(self) -> None:
        self.streams: dict[Any, Stream] = {}
        self.retiring: list[_Retiring] = []  # copies of ended streams still in flight
        self.local_drain = False  # inside upstream's unsynchronised (detach) drain
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                # One reader per piece in flight: a piece is a few pages, and reading
                # them one piece at a time leaves the store's queue shallow (13-page
                # batches read ~25% slower than 128-page ones; two at once do not).
                self._executor = ThreadPoolExecutor(MAX_INFLIGHT, thread_name_prefix="l3-stream-read")
            return self._executor

    def wait_reads(self) -> None:
        futures_wait([pc.future for s in self.streams.values() for pc in s.pieces])


def lane_of(pipe: Any) -> Lane:
    lane = pipe.__dict__.get("_l3_stream_lane")
    if lane is None:
        lane = pipe.__dict__["_l3_stream_lane"] = Lane()
    return lane


def lane_if_any(pipe: Any) -> Lane | None:
    """`pipe`'s lane without making one (None: no stream ever started on it), for
    readers that must not change the pipeline (a harness waiting on its reads:
    `sglang_l3.testing.stream_landing`)."""
    lane = pipe.__dict__.get("_l3_stream_lane")
    return lane if isinstance(lane, Lane) else None


def holds_buffers(pipe: Any) -> bool:
    """Whether `pipe`'s streams still hold device rows or host slots: a stream not yet
    ended, or copies of ended ones still in flight (freed by a later tick)."""
    lane = lane_if_any(pipe)
    return lane is not None and bool(lane.streams or lane.retiring)


def piece_size(host_tokens: int, page: int, fitting_hit: int | None = None) -> int:
    """Tokens per piece with a host KV pool of `host_tokens`: a page-aligned
    SGLANG_L3_STREAM_PIECE fraction of it; for a hit the host holds whole
    (`fitting_hit`, patch stream-fitting-hits) 1/FITTING_ROUNDS of that hit, page-rounded
    up, at most a regular piece. Also what restore_bench's piece-shaped store read uses."""
    frac = float(os.environ.get(ENV_PIECE, DEFAULT_PIECE_FRACTION))
    p = max(page, int(host_tokens * frac) // page * page)
    if fitting_hit is not None and FITTING_ROUNDS:
        p = min(p, -(-fitting_hit // FITTING_ROUNDS // page) * page)
    return p


def piece_tokens(pipe: Any) -> int:
    cache = pipe._cache
    return piece_size(cache.cache_controller.mem_pool_host.size, cache.page_size)


# --------------------------------------------------------------------------- IO
def _read_piece(cc: Any, op: Any, keys: list[str], host: torch.Tensor, prefix_keys: list[str] | None) -> int:
    """Store -> host slots (reader thread). Returns the leading pages read."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    page = cc.page_size
    done = 0
    prefix = list(prefix_keys) if prefix_keys is not None else None
    with cc.mem_pool_host.layout_lease():
        for i in range(0, len(keys), READ_BATCH_PAGES):
            batch = keys[i : i + READ_BATCH_PAGES]
            try:
                hit = cc.page_get_func(
                    op,
                    batch,
                    host[i * page : (i + len(batch)) * page],
                    HiCacheStorageExtraInfo(prefix_keys=prefix),
                )
            except Exception:
                logger.exception("streamed restore: store read failed (req %s)", op.request_id)
                return done
            done += hit
            if hit != len(batch):
                return done
            if prefix is not None:
                prefix = prefix + batch
    return done


def _read_held_piece(piece: int, *args: Any) -> int:
    """`_read_piece` behind the test fault read-hold (`sglang_l3.faults.hold_read`)."""
    from sglang_l3 import faults

    faults.hold_read(piece)
    return _read_piece(*args)


def _copy_to_device(cc: Any, host: torch.Tensor, rows: torch.Tensor, rows_host: torch.Tensor | None) -> Any:
    """Queue host piece -> private device rows R (all layers) and return the event recorded
    after it. Never blocks the scheduler thread.

    Indices: on the `direct` io backend upstream's `move_indices` reads the device indices
    to host (a device sync per piece on a GPU); `rows_host`, R's host copy taken once at the
    stream's start, is handed instead. The `kernel` backend keeps them on the device.

    Stream: upstream's load stream (`cc.l2_transfer_engine.host_to_device_stream`), as
    `HiCacheController.start_loading` queues load-backs. Fence: the load stream first waits
    for the forward stream (`cc.load_fence_stream`): rows just taken from the allocator may
    still be written by a forward pass in flight (overlap scheduling frees a finished
    request's rows while its last token is written), and for the scheduler's stream (index
    uploads). What the forward waits on: nothing reads R before admission; there the last
    piece's load-back is queued on this same stream after every piece copy, and the forward
    waits on that load's per-layer events (`LayerDoneCounter`), which therefore cover R.
    Buffers: the host slots are freed, and R (if the stream ends unused) returned to the
    allocator, only once the returned event has completed on every rank (`_tick`)."""
    from sglang.srt.utils import get_device_module

    from sglang_l3 import faults

    dm = get_device_module()
    stream = cc.l2_transfer_engine.host_to_device_stream
    entry = cc.mem_pool_host.anchor_entry
    hp = entry.host_pool
    h, d = cc.move_indices(host, rows if rows_host is None else rows_host)
    stream.wait_stream(dm.current_stream())
    if cc.load_fence_stream is not None and not faults.active(faults.SKIP_LOAD_FENCE):
        stream.wait_stream(cc.load_fence_stream)
    with dm.stream(stream):
        for layer in range(getattr(hp, "target_layer_num", hp.layer_num)):
            hp.load_to_device_per_layer(entry.device_pool, h, d, layer, cc.io_backend)
        done = dm.Event()
        done.record()
    for t in (h, d):
        if t.is_cuda:
            t.record_stream(stream)  # the caching allocator keeps them until the copy ran
    return done


# --------------------------------------------------------------------- lifecycle
def _aux_staging_short(cache: Any, info: Any, aux_hit_tokens: int) -> bool:
    """Whether upstream's aux staging for the final round (the Mamba checkpoint's host
    slot; SWA windows where there are any) cannot be allocated now: the same transfers and
    sizes `UnifiedRadixCache._alloc_prefetch_aux_staging` allocates, against each host
    pool's free slots. Host pools change only at lockstep points, so every rank agrees."""
    cc = cache.cache_controller
    pages = aux_hit_tokens // cache.page_size
    for transfers in info.comp_xfers.values():
        for t in transfers:
            if t.host_indices is not None or t.indices_from_pool:
                continue
            entry = cc.mem_pool_host.entry_map.get(t.name)
            if entry is None:
                continue
            need = min(len(t.keys or ()), pages) * entry.host_pool.page_size
            if need and entry.host_pool.available_size() < need:
                return True
    return False


def _restorable_flags(op: Any, hit_pages: int) -> list[int]:
    """flags[c] = 1 where this rank's store holds KV and the Mamba checkpoint at c pages
    past the stream's start (the hit query's sparse result; upstream's contract when a
    backend reports none: contiguous). The synced hit end is restorable on every rank."""
    flags = [0] * (hit_pages + 1)
    flags[hit_pages] = 1
    if op.assume_stored:
        return flags  # nothing was queried: only the end is known to hold a state
    offset = op.prefetch_kv_page_offset  # pages upstream trimmed off the queried head
    pages = op.pool_storage_result.restorable_prefix_pages
    if pages is None:
        pages = range(offset + 1, offset + hit_pages + 1)
    for q in pages:
        if 1 <= q - offset <= hit_pages:
            flags[q - offset] = 1
    return flags


def _truncate(cache: Any, op: Any, pages: int, reason: str = "device_capacity") -> None:
    """Cut the op's hit to its first `pages` pages; the Mamba sidecar follows the new end
    (the checkpoint there was vouched for on every rank by the MIN-reduced flags)."""
    cut = len(op.hash_value) - pages
    if op.sidecar_hash_values is not None:
        keep = op.sidecar_hit_pages - cut
        op.sidecar_hash_values = list(op.sidecar_hash_values[:keep])
        op.sidecar_hit_pages = keep
    op.hash_value = list(op.hash_value[:pages])
    op.storage_hit_count = pages * cache.page_size
    # The dropped tail is recomputed: upstream's own unfulfilled-token accounting.
    label = reason if cache.storage_metrics_collector is not None else None
    cache._resolve_storage_prefetch_tokens(op.handle, cut * cache.page_size, reason=label)


UPSTREAM = "upstream"  # start_stream's verdict: the (truncated) hit fits the host arena: upstream's path
WAIT = "wait"  # start_stream's verdict: park the hit, the device frees rows for it soon
_FLAGS = "_l3_restorable_flags"
_FLAGS_SHAPE = "_l3_restorable_flags_shape"  # (hit pages, page offset, start) the flags were agreed for
_WAITED = "_l3_waited_rows"


def waits_for_rows(cache: Any, hit_tokens: int) -> bool:
    """Whether a hit the device cannot take now waits for rows instead of being cut:
    when the whole device pool could hold it (the same on every rank). Test fault
    cut-not-wait: never (the cut of before, for the tests of what follows a cut)."""
    from sglang_l3 import faults

    if faults.active(faults.CUT_NOT_WAIT):
        return False
    return hit_tokens <= cache.token_to_kv_pool_allocator.size


def _restart_budget(cache: Any, handle: Any) -> None:
    """Upstream's `timeout` budget covers the store read: restart it while the hit
    waits for device rows (nothing is read meanwhile), as its own staged path stops
    the clock once the read is done and admission then defers on device capacity."""
    wait = cache._storage_prefetch_wait.get(handle)
    if wait is not None and not wait.expired and wait.timer.running:
        wait.timer.started_at = time.perf_counter()


_SCHEDULER = "_l3_scheduler"  # weakref to the scheduler that drains this cache's hits


def chunk_reserve(cache: Any) -> int:
    """Device rows the chunked prefill in progress has yet to allocate (its later chunks,
    page-rounded up). Upstream's admission counted them when it admitted the request, but
    they are allocated chunk by chunk, and a stream's rows are taken outside admission:
    a stream that took them left the next chunk nothing, and upstream stops the scheduler
    on `Prefill out of memory`. The same on every rank (the chunked request is)."""
    ref = cache.__dict__.get(_SCHEDULER)
    scheduler = ref() if ref is not None else None
    req = getattr(scheduler, "chunked_req", None)
    if req is None:
        return 0
    need = len(req.origin_input_ids) + len(req.output_ids) - req.kv.kv_allocated_len
    page = cache.page_size
    return max(0, -(-need // page) * page)


def _device_fit(pipe: Any, op: Any, hit_tokens: int, *, cut: bool = True) -> int:
    """Tokens of the hit the device pool can take now (free + evictable, page-floored;
    the last piece included, so admission does not defer on the restored part), and the
    longest restorable prefix within that, MIN-reduced across TP ranks (this runs in the
    hit drain, a lockstep point, for every stream start and every retry of a parked hit).

    A hit that waits for rows is retried every tick (issue 49): it evicts nothing while
    free + evictable rows cannot take it anyway (it would wait all the same, and the
    contexts evicted would be lost for nothing), and its per-length restorable flags
    (hit_pages + 1 entries: 262K at page size 1 and 256K tokens) are reduced once per
    shape of the op, then only the fit travels.

    `cut=False` (a hit that fits the host buffer, which is streamed only whole): evict
    only when free + evictable rows take the whole hit, never for a part of it."""
    cache = pipe._cache
    page = cache.page_size
    allocator = cache.token_to_kv_pool_allocator
    reserve = chunk_reserve(cache)  # rows a chunked prefill in progress still needs: not ours
    avail = allocator.available_size() - reserve
    if avail < hit_tokens and (
        avail + cache.full_evictable_size() >= hit_tokens or (cut and not waits_for_rows(cache, hit_tokens))
    ):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        cache.evict_for_alloc(EvictParams(num_tokens=hit_tokens - avail))
    fit = max(0, allocator.available_size() - reserve) // page * page
    hit_pages = hit_tokens // page
    shape = (hit_pages, op.prefetch_kv_page_offset, op.storage_start)
    agreed_flags = op.__dict__.get(_FLAGS) if op.__dict__.get(_FLAGS_SHAPE) == shape else None
    if agreed_flags is None:
        t = torch.tensor(_restorable_flags(op, hit_pages) + [fit], dtype=torch.int64)
        cache._all_reduce(t, torch.distributed.ReduceOp.MIN)
        agreed = t.tolist()
        agreed_flags = op.__dict__[_FLAGS] = agreed[:-1]  # kept for a cut below a damaged page (_storage_error)
        op.__dict__[_FLAGS_SHAPE] = shape
        fit = int(agreed[-1])
    else:
        t = torch.tensor([fit], dtype=torch.int64)
        cache._all_reduce(t, torch.distributed.ReduceOp.MIN)
        fit = int(t.item())
    if fit >= hit_tokens:
        return hit_tokens
    best = max((c for c in range(1, hit_pages + 1) if agreed_flags[c] and c * page <= fit), default=0)
    return best * page


def start_stream(pipe: Any, op: Any, hit_tokens: int, *, fitting: bool = False) -> Stream | str | None:
    """Start streaming `op`'s hit of `hit_tokens` (at a lockstep point: the hit drain).
    Returns the stream, `WAIT` (park the op, retry next tick), `UPSTREAM` (upstream's
    own path takes the op's hit as it is now) or None (declined: upstream's verdict).

    `fitting`: the hit fits the host buffer (patch `stream-fitting-hits`): pieces of
    1/FITTING_ROUNDS of it. Declines are silent (upstream's staged path takes the hit),
    and a device pool that cannot take the whole hit now answers `UPSTREAM` at once, the
    hit unchanged: no wait, no cut."""
    cache = pipe._cache
    cc = cache.cache_controller
    handle = op.handle
    page = cache.page_size

    def decline(reason: str) -> None:
        if fitting:
            return  # upstream's staged path takes a hit that fits the host: nothing declined
        metrics.inc("l3_stream_restore", f"declined_{reason}")
        logger.warning(
            "streamed restore declined req=%s reason=%s hit=%d",
            handle.rid,
            reason,
            hit_tokens,
        )

    if lane_of(pipe).local_drain:
        decline("detaching")  # no collective off the lockstep path; upstream declines
        return None
    if cache.supports_swa() or pipe._shared_host_domain() is not None:
        decline("layout")
        return None
    ctx = pipe._prefetch_prefix_ctx.get(handle)
    if ctx is None or len(ctx[0]) != op.storage_start or hit_tokens % page:
        decline("layout")
        return None
    # A hit the host holds whole: pieces of 1/FITTING_ROUNDS of it, so reads keep
    # running beside the copies.
    p = piece_size(cc.mem_pool_host.size, page, hit_tokens if fitting else None)
    if not cc.can_fit_prefetch_host_buffers(op, min(hit_tokens, p)):
        decline("host_too_small")
        return None
    fit = _device_fit(pipe, op, hit_tokens, cut=not fitting)
    if fitting and fit < hit_tokens:
        # Device rows are taken for a fitting hit only when the pool takes it whole now;
        # else it stays host-only until admission, upstream's staged path (the fit is
        # MIN-reduced: every rank answers alike).
        return UPSTREAM
    if fit < hit_tokens and waits_for_rows(cache, hit_tokens):
        # The pool could take the whole hit once rows held now go: running requests
        # finish, streams land, L3 writes stage (queued: patch write-guard, whose valve
        # opens them if a staged restore blocks the queue; D2H in flight: upstream's
        # lock). Wait for them, parked and holding nothing, instead of cutting the hit.
        # Upstream retries parked hits in order: the hits parked behind this one wait for
        # it, not for their own read, so their budgets restart too (issue 49: they expired
        # and recomputed while only the head's restarted).
        _restart_budget(cache, handle)
        for behind in pipe.pending_hit_allocs:
            _restart_budget(cache, behind.handle)
        if not op.__dict__.get(_WAITED):
            op.__dict__[_WAITED] = True
            write = fit + write_guard.write_held_tokens(pipe) >= hit_tokens
            metrics.inc("l3_stream_restore", "waited_write" if write else "waited_busy")
            logger.info(
                "streamed restore waits req=%s hit=%d fit=%d: rows held %s",
                handle.rid,
                hit_tokens,
                fit,
                "for queued L3 writes" if write else "by other requests",
            )
        return WAIT
    if fit == 0:
        decline("device_short")
        return None
    if fit < hit_tokens:
        # The device pool cannot hold the whole hit: restore the longest part ending at a
        # stored checkpoint that fits; the request computes the rest.
        metrics.inc("l3_stream_restore", "truncated_device")
        logger.warning(
            "streamed restore truncated req=%s reason=device_short hit=%d restorable=%d",
            handle.rid,
            hit_tokens,
            fit,
        )
        _truncate(cache, op, fit // page)
        hit_tokens = fit
        if cc.can_fit_prefetch_host_buffers(op, hit_tokens):
            return UPSTREAM
    k = -(-hit_tokens // p)
    r_len = (k - 1) * p
    if r_len <= 0 or not cc.can_fit_prefetch_host_buffers(op, hit_tokens - r_len):
        decline("host_too_small")
        return None
    allocator = cache.token_to_kv_pool_allocator
    rows = allocator.alloc(r_len) if allocator.available_size() >= r_len else None
    if rows is None:
        decline("device_short")
        return None
    lock = pipe.anchor_locks.get(handle)
    pin = None
    if lock is not None:
        cache.tree_core.inc_full_pin(lock.node_id)
        pin = lock.node_id
    s = Stream(
        handle=handle,
        op=op,
        start=op.storage_start,
        hit=hit_tokens,
        rows=rows,
        rows_host=host_copy(rows) if cc.io_backend == "direct" else None,
        keys=list(op.hash_value[: r_len // page]),
        prefix_keys=list(op.prefix_keys) if op.prefix_keys is not None else None,
        piece_pages=p // page,
        pin=pin,
        flags=list(op.__dict__.get(_FLAGS, ())),
    )
    lane_of(pipe).streams[handle] = s
    metrics.inc("l3_stream_restore", "started")
    logger.info(
        "streamed restore req=%s start=%d hit=%d rows=%d piece=%d rounds=%d%s",
        handle.rid,
        s.start,
        hit_tokens,
        r_len,
        p,
        k,
        " (fits the host buffer)" if fitting else "",
    )
    _launch_reads(pipe, s)
    return s


def _held(pipe: Any) -> bool:
    """Test-only fault stream-hold@PATH (`sglang_l3.faults.held`): streams start no read
    while PATH exists, so a test can queue requests behind a stream in flight; each change
    in the number of hits parked behind it is logged. The verdict is MAX-reduced (host
    slots a read takes feed later decisions: every rank must launch alike)."""
    from sglang_l3 import faults

    if not faults.active(faults.STREAM_HOLD):
        return False
    t = torch.tensor([int(faults.held(faults.STREAM_HOLD))], dtype=torch.int32)
    pipe._cache._all_reduce(t, torch.distributed.ReduceOp.MAX)
    held = bool(t.item())
    parked = len(pipe.pending_hit_allocs) if held else -1
    if faults.changed("stream-hold parked", parked) and held:
        logger.warning("streamed restore held by %s: hits parked=%d", faults.ENV, parked)
    return held


def _launch_reads(pipe: Any, s: Stream) -> None:
    from sglang_l3 import faults

    if _held(pipe):
        return
    cc = pipe._cache.cache_controller
    page = pipe._cache.page_size
    total = len(s.keys)
    while s.state == "reading" and len(s.pieces) < MAX_INFLIGHT and s.next_page < total:
        n = min(s.piece_pages, total - s.next_page)
        host = cc.mem_pool_host.alloc(n * page)
        if host is None:
            return  # host busy (writes, other staging): retry next tick
        cc.prefetch_tokens_occupied += n * page
        keys = s.keys[s.next_page : s.next_page + n]
        prefix = None if s.prefix_keys is None else s.prefix_keys + s.keys[: s.next_page]
        args = (cc, s.op, keys, host, prefix)
        if faults.active(faults.READ_HOLD):
            fut = lane_of(pipe).executor().submit(_read_held_piece, s.next_page // s.piece_pages, *args)
        else:
            fut = lane_of(pipe).executor().submit(_read_piece, *args)
        s.pieces.append(_Piece(s.next_page, n, host, fut))
        s.next_page += n


def _free_piece(pipe: Any, pc: _Piece) -> None:
    cc = pipe._cache.cache_controller
    cc.mem_pool_host.free(pc.host)
    cc.prefetch_tokens_occupied -= len(pc.host)


def _retire(pipe: Any, s: Stream, rows: torch.Tensor | None) -> None:
    """Hand the stream's copies in flight to the lane: their host slots, and `rows` (device
    rows the stream gives back), are freed once the last of them completed (`_tick`).
    With no copy in flight, `rows` are freed now."""
    lane = lane_of(pipe)
    pcs = list(s.copying)
    s.copying.clear()
    for i, pc in enumerate(pcs):
        last = i == len(pcs) - 1
        lane.retiring.append(_Retiring(pc.copied, pc.host, rows if last else None))
    if not pcs and rows is not None and len(rows):
        pipe._cache.token_to_kv_pool_allocator.free(rows)


def _end(pipe: Any, s: Stream, outcome: str, *, free_rows: bool = True) -> None:
    """Release what the stream still owns (rows, pin) exactly once; rows a copy may still
    be writing are freed when it completed (`_retire`)."""
    lane = lane_of(pipe)
    if lane.streams.get(s.handle) is not s:
        return
    del lane.streams[s.handle]
    assert not s.pieces, "stream ended with host pieces in flight"
    _give_back_device(pipe, s, free_rows=free_rows)
    metrics.inc("l3_stream_restore", outcome)


def _give_back_device(pipe: Any, s: Stream, *, free_rows: bool = True) -> None:
    """Give the stream's device rows (R unless `free_rows` is False, and the rows a cut
    gave up) and its anchor pin back, once: rows a copy may still be writing are freed
    when it completed (`_retire`)."""
    give = [t for t in (s.rows if free_rows else None, s.spare) if t is not None and len(t)]
    s.spare = None
    if free_rows:
        s.rows = s.rows[:0]
    _retire(pipe, s, torch.cat(give) if len(give) > 1 else (give[0] if give else None))
    if s.pin is not None:
        pipe._cache.tree_core.dec_full_pin(s.pin)
        s.pin = None


def abort_stream(pipe: Any, s: Stream, reason: str) -> None:
    if s.state == "aborting":
        return
    s.state, s.reason = "aborting", reason
    logger.warning(
        "streamed restore aborted req=%s reason=%s landed=%d/%d",
        s.handle.rid,
        reason,
        s.landed_pages,
        len(s.keys),
    )


def _leading_done(events: list[Any]) -> list[int]:
    """1 for each event of the completed prefix of `events` (polled in order), 0 after."""
    out, ok = [], True
    for ev in events:
        ok = ok and bool(ev.query())
        out.append(int(ok))
    return out


def _tick(cache: Any) -> None:
    """Once per check_hicache_events, identical on every rank: queue the copies of the
    pieces every rank has read, free the host slots (and rows) of the copies every rank
    has completed, start the next reads, end aborted streams."""
    pipe = cache.buffer_pipeline
    lane = lane_of(pipe)
    if not lane.streams and not lane.retiring:
        return
    streams = list(lane.streams.values())
    flags = []  # per piece: done, leading pages read (MIN: the first page some rank cannot read)
    for s in streams:
        pcs = list(s.pieces)[:MAX_INFLIGHT]
        for i in range(MAX_INFLIGHT):
            if i < len(pcs) and pcs[i].future.done():
                good = pcs[i].future.result() if pcs[i].future.exception() is None else 0
                flags += [1, int(good)]
            else:
                flags += [0, 0]
        flags += _leading_done([pc.copied for pc in s.copying])  # rank-identical lengths
    flags += _leading_done([r.copied for r in lane.retiring])
    t = torch.tensor(flags, dtype=torch.int32)
    cache._all_reduce(t, torch.distributed.ReduceOp.MIN)
    agreed = t.tolist()
    cc = cache.cache_controller
    at = 0
    retired = sum(agreed[len(agreed) - len(lane.retiring) :]) if lane.retiring else 0
    for r in lane.retiring[:retired]:
        if r.host is not None:
            cc.mem_pool_host.free(r.host)
            cc.prefetch_tokens_occupied -= len(r.host)
        if r.rows is not None:
            cache.token_to_kv_pool_allocator.free(r.rows)
    del lane.retiring[:retired]
    for s in streams:
        reads = agreed[at : at + 2 * MAX_INFLIGHT]
        at += 2 * MAX_INFLIGHT
        copied = sum(agreed[at : at + len(s.copying)])
        at += len(s.copying)
        for _ in range(copied):
            _free_piece(pipe, s.copying.popleft())
        info = cache.ongoing_prefetch.get(s.handle)
        if s.state in ("reading", "cutting", "ready", "final") and (info is None or info.operation is not s.op):
            abort_stream(pipe, s, "aborted")
        landed: list[_Piece] = []  # read everywhere, copied below
        for i in range(MAX_INFLIGHT):
            done, good = reads[2 * i : 2 * i + 2]
            if not done:
                break
            pc = s.pieces.popleft()
            if s.state in ("aborting", "cutting"):
                pass  # read after the stream stopped or was cut: not landed
            elif good == pc.pages:
                landed.append(pc)
                s.landed_pages += pc.pages
                metrics.inc("l3_stream_restore_pieces")
                continue
            else:
                _copy_landed(cc, s, landed)  # the cut keeps what landed before the damage
                _storage_error(cache, s, pc, good)
            _free_piece(pipe, pc)
        if s.state == "reading":
            # The next reads first, then the copies: on a device whose copy runs on this
            # thread (the CPU stack) or takes a while to queue (per-page launches), the
            # store reads the next piece meanwhile instead of after it.
            _launch_reads(pipe, s)
        _copy_landed(cc, s, landed)
        if s.state == "aborting":
            if not s.pieces and not s.copying:
                _end(pipe, s, s.reason)
            elif s.pieces and (len(s.rows) or s.spare is not None or s.pin is not None):
                # Reads still in flight (a slow or hung store) fill host slots only: the
                # device rows and the pin go now, so the request the stop policy sent to
                # recompute, and every other, is not kept off the device until they return.
                _give_back_device(pipe, s)
            continue
        if s.state == "cutting" and not s.pieces:
            if len(s.rows):
                s.state = "ready"  # upstream's final round reads [R, c) and the state at c
            else:
                _end(pipe, s, "cut_to_upstream")  # nothing landed to keep: the short hit is upstream's
        if s.state == "reading" and s.landed_pages == len(s.keys):
            s.state = "ready"


def _copy_landed(cc: Any, s: Stream, landed: list[_Piece]) -> None:
    """Queue the host -> R copies of `landed` pieces, in order (and empty the list); each
    piece's host slots are freed once its copy completed (`_tick`)."""
    page = cc.page_size
    for pc in landed:
        a = pc.first_page * page
        b = a + pc.pages * page
        pc.copied = _copy_to_device(cc, pc.host, s.rows[a:b], None if s.rows_host is None else s.rows_host[a:b])
        s.copying.append(pc)
    landed.clear()


def _storage_error(cache: Any, s: Stream, pc: _Piece, good: int) -> None:
    """Piece `pc` has a page some rank cannot read (rank-agreed: the first `good` pages
    of it were read everywhere). Cut at the deepest checkpoint below it, or recompute."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    page = cache.page_size
    bad = pc.first_page + good  # pages past the stream's start readable on every rank
    # The hit query vouched for these pages; heal beliefs so the recompute's insert rewrites.
    cache.storage_existence_cache.pool(PoolName.KV).invalidate_beyond(s.keys, bad)
    op = s.op
    c = max((q for q in range(1, min(bad, len(s.flags) - 1) + 1) if s.flags[q]), default=0)
    keep = (s.start + c * page - op.storage_start) // page  # pages of the (head-trimmed) op
    if c == 0 or keep <= 0 or cache.ongoing_prefetch.get(s.handle) is None:
        abort_stream(cache.buffer_pipeline, s, "storage_error")
        if cache.ongoing_prefetch.get(s.handle) is not None:
            # Parked op, no host slots of upstream's: the request recomputes.
            cache.revoke_pending_prefetch(s.handle)
            if op.assume_stored:
                # Nothing was queried (only the end was known to hold a state): a fresh
                # hit query finds the checkpoints below the damage (upstream's re-issue).
                cache.storage_prefetch_retries.refetch(s.handle.rid)
        return
    # Keep what landed below c (the final round reads at least one page, with the state).
    r = min(s.landed_pages, c - 1)
    _truncate(cache, op, keep, reason="storage_transfer")
    s.spare = s.rows[r * page :]
    s.rows, s.keys = s.rows[: r * page], s.keys[:r]
    if s.rows_host is not None:
        s.rows_host = s.rows_host[: r * page]
    s.hit, s.landed_pages, s.next_page = c * page, r, r
    s.state, s.reason = "cutting", "cut_storage_error"
    metrics.inc("l3_stream_restore", "cut_storage_error")
    logger.warning(
        "streamed restore cut req=%s reason=storage_error unreadable_page=%d restorable=%d kept_rows=%d",
        s.handle.rid,
        bad,
        c * page,
        r * page,
    )


# ------------------------------------------------------------------------ hooks
def apply(ctx: PatchContext) -> None:
    def allocate(orig: Any, self: Any, op: Any, info: Any, hit_tokens: int, aux_hit_tokens: int) -> bool:
        lane = lane_of(self)
        s = lane.streams.get(op.handle)
        if s is None:
            if self._cache.cache_controller.can_fit_prefetch_host_buffers(op, hit_tokens):
                return orig(self, op, info, hit_tokens, aux_hit_tokens)
            started = start_stream(self, op, hit_tokens)
            if started is None:
                return orig(self, op, info, hit_tokens, aux_hit_tokens)  # upstream declines
            if started == WAIT:
                self.release_anchor_lock(op.handle)
                return False
            if started == UPSTREAM:
                # Truncated to a hit the host arena takes whole: upstream's own path.
                hit_tokens = op.storage_hit_count
                aux = op.sidecar_hit_pages * self._cache.page_size if op.sidecar_hash_values is not None else hit_tokens
                return orig(self, op, info, hit_tokens, aux)
            self.release_anchor_lock(op.handle)  # parked ops hold no pin; ours is separate
            return False
        if s.op is not op and s.state != "staged":
            # A new op for this request (a re-query after a failed final round) while the
            # old stream still ends: its copies in flight hold host slots and rows until
            # they complete (when is up to the device). Park the new op until the old
            # stream is gone, then start afresh: never let upstream judge a hit only a
            # stream can take (it declines it for good).
            if self._cache.cache_controller.can_fit_prefetch_host_buffers(op, hit_tokens):
                return orig(self, op, info, hit_tokens, aux_hit_tokens)
            if s.state != "aborting":
                abort_stream(self, s, "aborted")  # what the next tick would find: its op is gone
            self.release_anchor_lock(op.handle)
            return False
        if s.op is not op or s.state not in ("reading", "cutting", "ready"):
            return orig(self, op, info, hit_tokens, aux_hit_tokens)
        if s.state in ("reading", "cutting"):
            self.release_anchor_lock(op.handle)
            return False
        # Final round: upstream's own prefetch of the last piece + the Mamba checkpoint.
        cache = self._cache
        trim = s.start + s.r_tokens - op.storage_start
        if trim < 0:
            # The device prefix grew past R meanwhile: R is redundant, upstream takes over.
            _end(self, s, "device_covered")
            return orig(self, op, info, hit_tokens, aux_hit_tokens)
        if not cache.cache_controller.can_fit_prefetch_host_buffers(op, hit_tokens - trim) or (
            cache.cache_controller.mem_pool_host.anchor_entry.host_pool.available_size() < hit_tokens - trim
        ):
            self.release_anchor_lock(op.handle)
            return False
        if _aux_staging_short(cache, info, aux_hit_tokens):
            # Upstream stages the Mamba checkpoint (and any other sidecar) beside the last
            # piece; its host slot may be held for a moment, e.g. by the other agent's turn
            # on its way to L3. Park the op untrimmed, as for a KV shortfall: upstream retries
            # it next tick at the anchor we pin. Upstream's own deferral would come after the
            # trim, and its retry of an op trimmed past the tree finds no anchor: the stream
            # ended and the request recomputed its whole context (agent_switch in CI).
            if not s.final_waited:
                s.final_waited = True
                metrics.inc("l3_stream_restore", "final_waited")
            self.release_anchor_lock(op.handle)
            return False
        if trim:
            info, hit_tokens, aux_hit_tokens = cache._trim_buffer_prefetch_full_head(
                op.handle, info, op, op.storage_start + trim, hit_tokens
            )
        s.state = "final"
        queued = orig(self, op, info, hit_tokens, aux_hit_tokens)
        if not queued:
            abort_stream(self, s, "final_deferred")
        return queued

    def stage(orig: Any, self: Any, request: Any, num_tokens: int, hash_value: list) -> bool:
        s = lane_of(self).streams.get(request)
        if s is None or s.state != "final":
            return orig(self, request, num_tokens, hash_value)
        res = orig(self, request, num_tokens, hash_value)
        f = self.staged_prefetches.get(request)
        end = s.start + s.hit
        if f is None or f.matched_len != s.start + s.r_tokens or f.matched_len + f.num_tokens != end:
            abort_stream(self, s, "final_short")
            _end(self, s, "final_short")
            return res
        s.f = (
            f.matched_len,
            f.num_tokens,
            list(f.hash_values),
        )  # the last piece, for admission
        f.matched_len = s.start
        f.num_tokens = end - s.start
        f.hash_values = s.keys + list(f.hash_values)
        cache = self._cache
        cache.prefetch_loaded_tokens_by_reqid[request] = f.num_tokens
        cache.prefetch_loaded_storage_start_by_reqid[request] = s.start
        from sglang.srt.mem_cache.hicache_storage import PoolName

        cache.storage_existence_cache.pool(PoolName.KV).add(s.keys)
        s.state = "staged"
        return res

    def load_back(
        orig: Any,
        self: Any,
        req: Any,
        f: Any,
        plan: Any,
        load_back_id: int,
        load_xfers: list,
    ) -> Any:
        s = lane_of(self).streams.get(f.request)
        if s is None or s.state != "staged":
            return orig(self, req, f, plan, load_back_id, load_xfers)
        base = s.start + s.r_tokens
        d = plan.device_prefix_len
        assert s.f is not None  # stage() set it before the state became staged
        matched, num, hashes = s.f
        f2 = msgspec.structs.replace(f, matched_len=matched, num_tokens=num, hash_values=hashes)
        new_d = max(d, base)
        plan2 = dataclasses.replace(plan, device_prefix_len=new_d, full_tokens=plan.full_tokens - (new_d - d))
        state, why = orig(self, req, f2, plan2, load_back_id, load_xfers)
        if state is None:
            return state, why  # deferred: R stays with the staged hold
        cut = min(max(d - s.start, 0), s.r_tokens)
        used, spare = s.rows[cut:], s.rows[:cut]
        state.device_indices = torch.cat([used.to(state.device_indices.device), state.device_indices])
        state.num_tokens = plan.full_tokens
        # R now belongs to the insert init_load_back makes next; the copies still in flight
        # into it are ahead of this load-back on the load stream, so the forward's per-layer
        # waits cover them. Their host slots, and the head rows the device prefix covers
        # (`spare`), are freed once they completed.
        s.rows = spare
        _end(self, s, "restored")
        return state, why

    def release_staged(orig: Any, self: Any, request: Any, reason: Any = None) -> bool:
        had = orig(self, request, reason)
        s = lane_of(self).streams.get(request)
        if s is not None and s.state == "staged":
            _end(self, s, f"released_{reason or 'abort'}")
        return had

    def progress(orig: Any, self: Any, request: Any) -> bool:
        pipe = self.buffer_pipeline
        s = lane_of(pipe).streams.get(request) if pipe is not None else None
        info = self.ongoing_prefetch.get(request)
        if s is None or s.state not in ("reading", "cutting", "ready") or info is None or info.operation is not s.op:
            return orig(self, request)  # the final round is upstream's own prefetch: its policy applies
        # Rounds 1..k-1: upstream's op is parked, so upstream would stop it at once;
        # apply the stop policy to the stream instead (same rank-agreed vote and time
        # budget as upstream's: base + per page of the whole hit, from the first poll).
        if self.prefetch_stop_policy == "wait_complete" or not self._can_terminate_prefetch(s.op):
            self._start_storage_prefetch_wait(s.op)
            return False
        abort_stream(pipe, s, f"stop_{self.prefetch_stop_policy}")
        return orig(self, request)  # revokes the parked op (deadline / miss); the tick frees R

    def events(orig: Any, self: Any) -> None:
        orig(self)
        if self.buffer_pipeline is not None and self.linker is None:
            _tick(self)

    def add_one_req(orig: Any, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        # R is allocated already (it is not in the budget's available tokens), yet the
        # admission charges the whole span as new tokens: credit the rows the splice uses.
        pipe = getattr(self.tree_cache, "buffer_pipeline", None)
        handle = getattr(req, "cache_request_handle", None)
        s = lane_of(pipe).streams.get(handle) if pipe is not None and handle is not None else None
        plan = getattr(req, "staged_prefetch_plan", None)
        if s is None or s.state != "staged" or plan is None:
            return orig(self, req, *args, **kwargs)
        credit = s.r_tokens - min(max(plan.device_prefix_len - s.start, 0), s.r_tokens)
        budget = self.memory_budget
        budget.total_offset -= credit
        budget.current_offset -= credit
        res = orig(self, req, *args, **kwargs)
        if not any(r is req for r in self.can_run_list):
            budget.total_offset += credit
            budget.current_offset += credit
        return res

    def reset(orig: Any, self: Any) -> None:
        lane = self.__dict__.pop("_l3_stream_lane", None)
        if lane is not None:
            # Pools are cleared wholesale by the cache reset: drop, never free twice; no
            # copy of ours may land after it.
            lane.wait_reads()
            for ev in [pc.copied for s in lane.streams.values() for pc in s.copying]:
                ev.synchronize()
            for r in lane.retiring:
                r.copied.synchronize()
            lane.streams.clear()
            lane.retiring.clear()
        orig(self)

    def is_idle(orig: Any, self: Any) -> bool:
        # Upstream's scheduler checks its pools for leaks whenever it is fully idle, and
        # idle includes this pipeline's own verdict: rows R and host slots of a stream that
        # is still ending (an abort lands between ticks; copies in flight are acked later)
        # are in no count of its check. Not idle until the tick has freed them.
        return bool(orig(self)) and not holds_buffers(self)

    def local_drain(orig: Any, self: Any) -> None:
        lane = lane_of(self.buffer_pipeline) if self.buffer_pipeline is not None else None
        if lane is None:
            return orig(self)
        lane.local_drain = True
        try:
            return orig(self)
        finally:
            lane.local_drain = False

    def hicache_events(orig: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        # the scheduler whose chunked prefill a stream's rows must leave room for
        # (`chunk_reserve`); hits are drained here
        cache = getattr(self, "tree_cache", None)
        if cache is not None and _SCHEDULER not in cache.__dict__:
            cache.__dict__[_SCHEDULER] = weakref.ref(self)
        return orig(self, *args, **kwargs)

    ctx.around(f"{PIPE}.allocate_and_queue_prefetch", allocate)
    ctx.around(f"{SCHED}._process_hicache_events", hicache_events)
    ctx.around(f"{URC}.drain_storage_control_queues_local", local_drain)
    ctx.around(f"{PIPE}.stage_completed_prefetch", stage)
    ctx.around(f"{PIPE}._allocate_and_queue_load_back", load_back)
    ctx.around(f"{PIPE}.release_staged_hold", release_staged)
    ctx.around(f"{PIPE}.reset", reset)
    ctx.around(f"{PIPE}.is_idle", is_idle)
    ctx.around(f"{URC}.check_prefetch_progress", progress)
    ctx.around(f"{URC}.check_hicache_events", events)
    ctx.around(f"{ADDER}.add_one_req", add_one_req)
