#!/usr/bin/env python3
"""Streamed L3 restore at real model sizes: storage -> small host buffer -> device.

One rank of TP=2 for Qwen3-Next-80B-A3B and Qwen3.5-27B, through the real upstream
cache stack on CPU (`sglang_l3.testing.stack.L3Stack`: UnifiedRadixCache +
HybridCacheController + buffer-only HiCache) and our store (patch store-file), with
the streamed patches (issue 11). Per row (model, context, host staging buffer):
tokens, bytes, restore seconds (storage -> device, cold page cache), GB/s, and two
baselines that read the same bytes as the restore (every KV page and the last page's
Mamba state) with the restore's own reader concurrency (two readers, as its two
pieces in flight), measured right before each restore: the store's own cold read
(`store_GB/s`, checked pages, 128 pages a call) and the raw disk's (`raw_GB/s`: the
same files whole, O_DIRECT, unchecked, as many requests in flight as the store's two
readers issue). `ratio` = restore / store, `vs_raw` =
restore / raw disk (medians over --repeat such triples, default 3). Then CPU-seconds
per GiB of the restore and of the store read (`store_cpu`: what reading and checking
the pages costs by itself), and upstream's
result on the same row (restored tokens with the patch `streamed-restore` undone
in-process; 0 where upstream declines). Last, the request size: `pages/call`, the
pages per store call the restore made (its pieces through this buffer,
`streamed_restore.piece_size`, at most 128; 128 on upstream's staged path), and where
that is under the store row's 128, `piece_GB/s`, the store's read of the same pages in
calls of that size, two readers, measured right after each restore (else the store
row's figure), with `vs_piece` = restore / it. `ratio` counts the small buffer's
smaller reads against the restore; `vs_piece` does not (like for like in request size).

Per-rank sizes (TP=2) from the models' public config.json fields
(HF `text_config` for Qwen3.5), with SGLang 0.5.23's own formulas:
`Qwen3NextConfig.mamba2_cache_params` (inherited by `Qwen3_5TextConfig`) ->
`Mamba2StateShape.create(intermediate_size=linear_value_head_dim*linear_num_value_heads,
n_groups=linear_num_key_heads, num_heads=linear_num_value_heads,
head_dim=linear_value_head_dim, state_size=linear_key_head_dim)`:
conv_dim = intermediate + 2*n_groups*state_size, conv state (conv_dim/tp, kernel-1),
temporal state (num_heads/tp, head_dim, state_size). Full-attention layers =
num_hidden_layers / full_attention_interval, the rest Gated-DeltaNet (GDN); KV in
bf16; the GDN temporal state fp32 (`mamba2_state_dtype`: config mamba_ssm_dtype
"float32", also the default), the conv state bf16. The MTP layer
(mtp_num_hidden_layers=1) is not counted: it holds state only with speculative
decoding on. The packaged tiny-qwen35 keeps the 27B's layer pattern, value/key head
ratio and equal head dims at toy sizes (docs/state-budget.md, "The tiny models").

  Qwen3-Next-80B-A3B: num_hidden_layers=48, full_attention_interval=4 -> 12 full, 36 GDN;
    num_key_value_heads=2, head_dim=256; linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4.
    KV / token / rank  = 12 layers x 2 (K,V) x (2/2) heads x 256 x 2 B        = 12,288 B
    GDN state / rank   = 36 x [ (32/2) x 128 x 128 x 4 B                        (temporal)
                               + (32x128 + 2x16x128)/2 x (4-1) x 2 B ]       (conv)
                       = 36 x (1,048,576 + 24,576)                            = 38,633,472 B
  Qwen3.5-27B (checked against the public config: text_config num_hidden_layers=64,
    full_attention_interval=4, num_attention_heads=24, num_key_value_heads=4,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    mamba_ssm_dtype="float32"; model card: 64 layers = 16 x (3 GDN + 1 full)):
    -> 16 full, 48 GDN.
    KV / token / rank  = 16 x 2 x (4/2) x 256 x 2 B                            = 32,768 B
    GDN state / rank   = 48 x [ (48/2) x 128 x 128 x 4 B                        (temporal)
                               + (48x128 + 2x16x128)/2 x 3 x 2 B ]             (conv)
                       = 48 x (1,572,864 + 30,720)                            = 76,972,032 B

Contexts 8K, 32K, 128K (256K with --contexts). Host staging buffers 1/16, 1/4 and
1.2 x the context. Memory: one row at a time (device KV for the context + the host
buffer + the Mamba pools, ~20 states: `row_gib`), everything freed and collected
before the next; a row runs when its estimate fits MemAvailable - 2 GiB read just
before it (or --max-gib), and is printed as skipped otherwise - never scaled. The
writer uses a 1/4 buffer (streamed write); each of the store read's two readers uses
one reused host region of a call's pages (128, or the restore's piece). Cold reads: page cache dropped (or fadvise(DONTNEED) per file without
root) before every read; pools are faulted in before the timer starts.
What the timer covers: the restore a request gets, from the prefetch's first store
read to the ack — the store's reads, the host->device copies, the scheduler
stand-in's ticks, admission (`init_load_back`) and the forward pass's per-layer
waits. Not in it: the test harness's forward-time read of every restored row and
state (`L3Stack.admit(check_forward=False)`; e35d329 put it in the timer and the
figure read 4x slower than a restore, issue 34). Every run verifies the result
after the timer stops (`L3Stack.verify_restored`: every layer's KV on the path,
the node's and the request's Mamba slots): the `exact` column.

The guard (`make bench-check`, in .ci/run after the tests): `--min-ratio
1/16=0.275,1/4=0.4,1.2=0.4` exits 1 when a row's ratio is below its floor or a
row is not exact, skipped or failed; `--check-inside-timer` is its negative
control (the harness's read back inside the timer: the guard must fail).

Not a test: numbers only. The last line is exactly

  restore_vs_store=R small_buffer_restored=F upstream_small_buffer_restored=U

R = end-to-end restore GB/s / store read GB/s at the largest context with the 1/16
buffer (the smaller of the models' ratios), F and U = fraction of tokens restored
with the 1/16 buffer (ours: the smallest over rows; upstream: the largest; nan
with --no-upstream).

`--device cuda` (a CUDA/ROCm GPU): the device pools live on the GPU and upstream's
load stream copies with real DMAs (no CPU switch); each row then also prints
`h2d_GB/s`, one bulk pinned-host -> device copy of the row's bytes (the copy engine's
own rate, beside which the restore's piece copies can be judged).

Example: nice -n 10 python benchmark/restore_bench.py --contexts 8192,32768,131072
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

TP = 2
PAGE = 64
BUFFERS = (("1/16", 1 / 16), ("1/4", 1 / 4), ("1.2", 1.2))
WRITE_MARKER = 2.0  # the Mamba state's salt (L3Stack.write); verify_restored checks it


@dataclass(frozen=True)
class ModelShape:
    """The config.json fields the per-rank cache sizes derive from."""

    name: str
    num_hidden_layers: int
    full_attention_interval: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @classmethod
    def from_config(cls, name: str, text_config: dict[str, Any]) -> ModelShape:
        """From a config.json's text-backbone fields (`text_config` of a multimodal
        model): e.g. the packaged tiny models (test/unit/test_tiny_models.py checks
        tiny-qwen35 against the Qwen3.5-27B row below)."""
        return cls(name, *(int(text_config[f.name]) for f in fields(cls) if f.name != "name"))

    @property
    def full_layers(self) -> list[int]:
        n = self.full_attention_interval
        return [i for i in range(self.num_hidden_layers) if (i + 1) % n == 0]

    def kv_bytes_per_token(self, tp: int = TP) -> int:
        return len(self.full_layers) * 2 * (self.num_key_value_heads // tp) * self.head_dim * 2

    def conv_dim(self, tp: int = TP) -> int:
        k = self.linear_num_key_heads * self.linear_key_head_dim
        v = self.linear_num_value_heads * self.linear_value_head_dim
        return (2 * k + v) // tp

    def state_bytes(self, tp: int = TP) -> int:
        gdn = self.num_hidden_layers - len(self.full_layers)
        temporal = (self.linear_num_value_heads // tp) * self.linear_key_head_dim * self.linear_value_head_dim * 4
        conv = self.conv_dim(tp) * (self.linear_conv_kernel_dim - 1) * 2
        return gdn * (temporal + conv)


MODELS = (
    ModelShape("Qwen3-Next-80B-A3B", 48, 4, 2, 256, 16, 32, 128, 128, 4),
    ModelShape("Qwen3.5-27B", 64, 4, 4, 256, 16, 48, 128, 128, 4),
)


def hybrid_spec(m: ModelShape, context: int, tp: int = TP) -> Any:
    """An L3Stack spec with one TP rank's shapes of model `m` for `context` tokens."""
    from sglang_l3.testing.stack import HybridSpec

    return HybridSpec(
        page_size=PAGE,
        num_layers=m.num_hidden_layers,
        full_attention_layer_ids=tuple(m.full_layers),
        kv_size=context + 4 * PAGE,
        head_num=m.num_key_value_heads // tp,
        head_dim=m.head_dim,
        dtype=torch.bfloat16,
        max_num_reqs=2,
        max_context_len=context + 2 * PAGE,
        mamba_cache_size=4,
        mamba_intermediate_size=(m.linear_num_value_heads // tp) * m.linear_value_head_dim,
        mamba_n_groups=m.linear_num_key_heads // tp,
        mamba_num_heads=m.linear_num_value_heads // tp,
        mamba_head_dim=m.linear_value_head_dim,
        mamba_state_size=m.linear_key_head_dim,
        mamba_conv_kernel=m.linear_conv_kernel_dim,
        ssm_dtype="float32",
    )


def host_budget() -> int:
    """Upstream books host pools against this (the harness default is half of what is
    available, too little for a 128K row's 1.2 buffer): the RAM available now less
    1 GiB. The rows' own budget (`row_gib`) is checked before each row."""
    import psutil

    return max(0, psutil.virtual_memory().available - (1 << 30))


def buffer_args(spec: Any, tokens: int) -> dict:
    return {"hicache_ratio": max(tokens, PAGE) / spec.kv_size}


def drop_page_cache(path: str) -> str:
    """Make the next read of `path`'s files cold; returns how."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            os.sync()
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    os.sync()
    for root, _, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise(DONTNEED)"


def write_context(m: ModelShape, context: int, store: str) -> tuple[list[int], list[str]]:
    """Write one `context`-token sequence through a 1/4 buffer; return (tokens, KV page keys)."""
    from sglang_l3.testing.stack import L3Stack

    spec = hybrid_spec(m, context)
    seq = [(i * 7919) % 150_000 + 1 for i in range(context)]
    with L3Stack(spec, store, server_args=buffer_args(spec, context // 4), host_budget_bytes=host_budget()) as w:
        w.write(seq, marker=WRITE_MARKER)
        w.settle(timeout=3600)
        node = w.match(seq).last_device_node
        keys = list(w.cache.tree_core.snapshot_buffer_backup(node, False).hash_values)
    free_memory()
    return seq, keys


def measure_restore(
    m: ModelShape, seq: list[int], store: str, buffer_tokens: int, *, check_inside_timer: bool = False
) -> dict:
    """Cold storage -> device restore through a `buffer_tokens` host buffer. The timer
    covers what a restore is: the prefetch's store reads and host->device copies, the
    scheduler stand-in's ticks, admission (`init_load_back`), the forward pass's
    per-layer waits and the ack. The result (every layer's KV, both Mamba slots) is
    verified after the timer stops (`L3Stack.verify_restored`), every run.
    `check_inside_timer`: the negative control of `make bench-check` — the test
    harness's forward-time read and comparison run inside the timer, as they did
    from e35d329 until issue 34."""
    from sglang_l3 import metrics
    from sglang_l3.testing.stack import L3Stack, RestoreFailed

    spec = hybrid_spec(m, len(seq))
    with L3Stack(spec, store, server_args=buffer_args(spec, buffer_tokens), host_budget_bytes=host_budget()) as st:
        cc = st.cache.cache_controller
        cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)  # upstream's limit
        host = cc.mem_pool_host.size
        # Fault every pool page in first (a serving process's pools are resident;
        # a CPU stand-in's first touch would bill the kernel's zeroing to the
        # restore), and scribble the device pools so a stale read fails `exact`.
        st.scribble()
        touch_host_pools(cc)
        how = drop_page_cache(store)
        before = {k: metrics.get("l3_stream_restore", k) for k in ("started", "fitting")}
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            req, loaded = restore_busy(st, seq, check_forward=check_inside_timer)
        except RestoreFailed:
            req, loaded = None, 0
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        streamed = {k: metrics.get("l3_stream_restore", k) > n for k, n in before.items()}
        exact = None
        if req is not None:
            try:
                st.verify_restored(seq, req, loaded, WRITE_MARKER)
                exact = True
            except RestoreFailed as e:
                log(f"  not exact: {e}")
                exact = False
            st.release(req)
        del req, st
    free_memory()  # the cache's reference cycles hold the pools until collected
    return {
        "host": host,
        "loaded": loaded,
        "wall": wall,
        "cpu": cpu,
        "exact": exact,
        "cold": how,
        "piece_pages": restore_piece_pages(host, len(seq), streamed["started"], streamed["fitting"]),
    }


def restore_piece_pages(host_tokens: int, hit_tokens: int, streamed: bool, fitting: bool) -> int:
    """Pages per store call the restore made: its pieces' (streamed_restore.piece_size)
    when it streamed, at most READ_BATCH_PAGES a call; upstream's staged path reads in
    batches of READ_BATCH_PAGES (its STORAGE_BATCH_SIZE)."""
    from sglang_l3.patches.hicache.streamed_restore import READ_BATCH_PAGES, piece_size

    if not streamed:
        return READ_BATCH_PAGES
    piece = piece_size(host_tokens, PAGE, hit_tokens if fitting else None)
    return min(piece // PAGE, READ_BATCH_PAGES)


def touch_host_pools(cc: Any) -> None:
    """Write every host pool buffer once (see measure_restore)."""
    seen: set[int] = set()

    def fill(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.data_ptr() not in seen:
                seen.add(x.data_ptr())
                x.fill_(0)
        elif isinstance(x, (list, tuple)):
            for y in x:
                fill(y)

    for entry in getattr(cc.mem_pool_host, "entries", None) or []:
        for name in ("kv_buffer", "temporal_buffer", "conv_buffer"):
            fill(getattr(entry.host_pool, name, None))


def restore_busy(
    st: Any, seq: list[int], *, check_forward: bool = False, on_tick: Callable[[Any], None] | None = None
) -> tuple[Any, int]:
    """`L3Stack.restore` with a scheduler-loop stand-in that ticks as soon as there
    is work, as upstream's loop does while a prefetch is in progress: at once when a
    piece copy completed (its host slots go to the next read), else it blocks on the
    read the streamed restore lands next (an event), else polls every 0.5 ms
    (`testing.stack.wait_for_work`). No forward-time check unless `check_forward`
    (see measure_restore). `on_tick(handle)` runs after every tick until the prefetch
    is done (a benchmark's observer: agent_switch times the wait for device rows)."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang_l3.testing.stack import RestoreFailed, wait_for_work

    cache = st.cache
    bp = cache.buffer_pipeline
    h = CacheRequestHandle("bench", 0)
    cache.prefetch_from_storage(h, cache.root_node_handle(), array("q", seq), None, None)
    deadline = time.monotonic() + 3600
    while not (cache.check_prefetch_progress(h) and (bp.has_staged(h) or h not in bp.staged_prefetches)):
        if time.monotonic() > deadline:
            raise RestoreFailed("prefetch did not finish")
        cache.check_hicache_events()
        if on_tick is not None:
            on_tick(h)
        wait_for_work(cache)
    cache.pop_prefetch_loaded_tokens(h)
    if not bp.has_staged(h):
        return None, 0
    return st.admit(h, seq, "bench", check_forward=check_forward)


def measure_upstream(m: ModelShape, seq: list[int], store: str, buffer_tokens: int) -> int:
    """Tokens upstream restores on the same row (the streamed-restore patch undone)."""
    from sglang_l3.patches import framework

    spec = next(s for s in framework.load_series() if s.id == "streamed-restore")
    framework.undo("streamed-restore")
    try:
        return measure_restore(m, seq, store, buffer_tokens)["loaded"]
    finally:
        framework.apply_one(spec)


def measure_store_read(m: ModelShape, keys: list[str], store: str, batch_pages: int | None = None) -> dict:
    """The store's own cold read of what a restore reads: every KV page and the Mamba
    state at the last page, with the restore's reader concurrency (MAX_INFLIGHT reader
    threads), `batch_pages` pages a call (default READ_BATCH_PAGES, the most a restore's
    store call reads; a streamed restore's pieces through a small host buffer are
    smaller: `restore_piece_pages`), each reader into its own reused host region of a
    small stack: what the disk and the store deliver for the same bytes, without a
    context-sized host pool."""
    from concurrent.futures import ThreadPoolExecutor

    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang_l3.patches.hicache.streamed_restore import MAX_INFLIGHT, READ_BATCH_PAGES
    from sglang_l3.storage.store import ReadItem
    from sglang_l3.testing.stack import L3Stack

    batch_pages = batch_pages or READ_BATCH_PAGES
    region = min(len(keys), batch_pages) * PAGE
    spec = hybrid_spec(m, MAX_INFLIGHT * region)
    with L3Stack(
        spec, store, server_args=buffer_args(spec, MAX_INFLIGHT * region), host_budget_bytes=host_budget()
    ) as st:
        cc = st.cache.cache_controller
        be = cc.storage_backend
        hosts = [cc.mem_pool_host.alloc(region) for _ in range(MAX_INFLIGHT)]
        state_spec = be.store.pool_spec(be.pool_layout(PoolName.MAMBA))
        state_buf = bytearray(state_spec.payload_len)
        touch_host_pools(cc)  # as for the restore: resident memory, cold disk
        batches = [keys[i : i + batch_pages] for i in range(0, len(keys), batch_pages)]

        def reader(r: int) -> int:
            ok = 0
            for batch in batches[r::MAX_INFLIGHT]:
                ok += sum(bool(x) for x in be.batch_get_v1(batch, hosts[r][: len(batch) * PAGE]))
            return ok

        drop_page_cache(store)
        c0, t0 = time.process_time(), time.perf_counter()
        with ThreadPoolExecutor(MAX_INFLIGHT) as pool:
            ok = sum(pool.map(reader, range(MAX_INFLIGHT)))
        state_ok = be.store.read([ReadItem(keys[-1], state_spec, [memoryview(state_buf)])]) == [True]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for h in hosts:
            cc.mem_pool_host.free(h)
    free_memory()
    return {"pages": ok, "state": state_ok, "wall": wall, "cpu": cpu}


def page_paths(m: ModelShape, keys: list[str], store: str) -> tuple[list[tuple[str, int]], int]:
    """The files a restore reads (every KV page, the last page's Mamba state) and their
    sizes, as the store names them; and the store's requests in flight per read call
    (its IO engine's O_DIRECT workers, `io_threads`)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang_l3.testing.stack import L3Stack

    spec = hybrid_spec(m, PAGE)
    with L3Stack(spec, store, server_args=buffer_args(spec, PAGE), host_budget_bytes=host_budget()) as st:
        be = st.cache.cache_controller.storage_backend
        kv = be.store.pool_spec(be.pool_layout(PoolName.KV))
        state = be.store.pool_spec(be.pool_layout(PoolName.MAMBA))
        files = [be.store.path_of(k, kv) for k in keys] + [be.store.path_of(keys[-1], state)]
        depth = be.settings.io_threads
    free_memory()
    return [(f, os.path.getsize(f)) for f in files], depth


RAW_BLOCK = 4 << 20  # bytes per raw request: a KV page file whole, a state file in blocks


def measure_raw_read(files: list[tuple[str, int]], store: str, readers: int) -> dict:
    """The raw disk's cold read of the same files: O_DIRECT where the filesystem has
    it, in requests of at most RAW_BLOCK bytes taken by `readers` threads (the store's
    requests in flight) into resident buffers, no checks: what the disk delivers to a
    reader that neither checks nor places anything."""
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    direct = getattr(os, "O_DIRECT", 0)
    blocks = [(path, off, min(RAW_BLOCK, n - off)) for path, n in files for off in range(0, n, RAW_BLOCK)]
    size = (max(b[2] for b in blocks) + 4095) // 4096 * 4096
    bufs = [mmap.mmap(-1, size) for _ in range(readers)]
    for b in bufs:
        b.write(bytes(size))  # resident before the timer, as the restore's pools are
    todo = iter(blocks)
    lock = threading.Lock()

    def reader(r: int) -> int:
        got = 0
        while True:
            with lock:
                block = next(todo, None)
            if block is None:
                return got
            path, off, n = block
            try:
                fd = os.open(path, os.O_RDONLY | direct)
            except OSError:  # no O_DIRECT on this filesystem
                fd = os.open(path, os.O_RDONLY)
            try:
                view = memoryview(bufs[r])[: (n + 4095) // 4096 * 4096]
                got += min(n, os.preadv(fd, [view], off))
                view.release()
            finally:
                os.close(fd)

    drop_page_cache(store)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        got = sum(pool.map(reader, range(readers)))
    wall = time.perf_counter() - t0
    for b in bufs:
        b.close()
    return {"bytes": got, "wall": wall}


# Pools besides the KV ones, in Mamba states (device slots, the requests' own and
# speculative slots, host slots): calibrated on Qwen3.5-27B at 8K and 32K (peak RSS
# over the baseline = KV bytes + ~19.5 states).
STATE_OVERHEAD = 20


def row_gib(m: ModelShape, context: int, buffer_tokens: int) -> float:
    """Peak memory of one restore row: device KV + host buffer + the Mamba pools."""
    kv = m.kv_bytes_per_token() * (context + 4 * PAGE + buffer_tokens)
    return (kv + STATE_OVERHEAD * m.state_bytes()) / 2**30


def write_gib(m: ModelShape, context: int) -> float:
    """Peak memory of writing the context (device KV + a 1/4 host buffer)."""
    return row_gib(m, context, context // 4)


def free_memory() -> None:
    """Collect the last stack's pools and hand the freed heap back to the OS: glibc
    keeps freed pool buffers of up to its (self-raising) mmap threshold in its
    arenas, so without the trim a row's RSS stayed until the next one allocated
    and two rows' pools coexisted at the peak (a 256K row was OOM-killed so)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def mem_budget_gib(fixed: float | None) -> float:
    """--max-gib, or what is available now less a 2 GiB margin (rows run one at a
    time and free everything before the next: the budget is re-read per row)."""
    free_memory()
    if fixed is not None:
        return fixed
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
    return avail / 2**20 - 2.0


def fits(need_gib: float, fixed: float | None) -> bool:
    """The estimate measured 10-15% under the peak at 256K (the host pool is shared
    memory, and upstream's per-token side tables grow with the context)."""
    return 1.15 * need_gib <= mem_budget_gib(fixed)


def measure_h2d(nbytes: int) -> float:
    """One bulk pinned-host -> device copy of `nbytes` (the GPU's copy engine, as fast as
    a restore's copies can be): seconds, after a warm-up copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    del src, dst
    torch.cuda.empty_cache()
    return wall


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8192,32768,131072", help="comma-separated token counts")
    ap.add_argument("--models", default=",".join(m.name for m in MODELS))
    ap.add_argument(
        "--max-gib",
        type=float,
        default=None,
        help="skip rows needing more memory (default: MemAvailable - 2 GiB, re-read before each row)",
    )
    ap.add_argument(
        "--buffers",
        default=",".join(b for b, _ in BUFFERS),
        help="comma-separated host buffers to run (of 1/16, 1/4, 1.2; default: all)",
    )
    ap.add_argument("--dir", default=None, help="store directory (default: a temp dir, removed)")
    ap.add_argument("--repeat", type=int, default=3, help="(store read, restore) pairs per row; medians are printed")
    ap.add_argument("--no-upstream", action="store_true", help="skip upstream's row (the upstream column prints -)")
    ap.add_argument(
        "--min-ratio",
        default=None,
        metavar="BUF=R,...",
        help="the guard (`make bench-check`): exit 1 when a row's restore/store ratio with buffer BUF "
        "(1/16, 1/4, 1.2) is below R, or a row is not exact, skipped or failed",
    )
    ap.add_argument(
        "--check-inside-timer",
        action="store_true",
        help="negative control of the guard: time the test harness's forward-time read and comparison "
        "with the restore (what this benchmark timed from e35d329 until issue 34)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the device pools live: cpu (the CPU stand-in) or cuda (a CUDA/ROCm GPU: real copy engine)",
    )
    args = ap.parse_args(argv)
    guard = parse_min_ratio(args.min_ratio) if args.min_ratio else {}
    buffers = [(b, f) for b, f in BUFFERS if b in args.buffers.split(",")]
    if not buffers or len(buffers) != len(set(args.buffers.split(","))):
        ap.error(f"--buffers: choose from {', '.join(b for b, _ in BUFFERS)}")
    if set(guard) - {b for b, _ in buffers}:
        ap.error("--min-ratio names a buffer --buffers leaves out")
    problems: list[str] = []

    prepare(args.device)
    from sglang_l3.patches.hicache.streamed_restore import MAX_INFLIGHT, READ_BATCH_PAGES  # the restore's readers

    contexts = [int(x) for x in args.contexts.split(",")]
    models = [m for m in MODELS if m.name in args.models.split(",")]

    budget = f"--max-gib {args.max_gib:.1f} GiB" if args.max_gib else "MemAvailable - 2 GiB, re-read per row"
    print(
        f"# per-rank sizes, TP={TP}, page {PAGE}; memory budget {budget} (upstream host reserve lowered to 1 GiB); "
        f"device {device_name(args.device)}"
    )
    for m in models:
        print(f"# {m.name}: KV {m.kv_bytes_per_token()} B/token, GDN state {m.state_bytes()} B")
    hdr = (
        f"{'model':20s} {'context':>8s} {'buffer':>6s} {'host_tok':>8s} {'tokens':>8s} {'bytes':>12s} "
        f"{'restore_s':>9s} {'GB/s':>6s} {'store_GB/s':>10s} {'raw_GB/s':>8s} {'ratio':>6s} {'vs_raw':>7s} {'cpu_s/GiB':>9s} {'store_cpu':>9s} {'exact':>5s} {'upstream':>8s}"
        f" {'pages/call':>10s} {'piece_GB/s':>10s} {'vs_piece':>8s}"
        + (f" {'h2d_GB/s':>8s}" if args.device == "cuda" else "")
    )
    print(hdr)
    small: list[tuple[int, float, float, float]] = []  # (context, R, F, U)
    for m in models:
        for context in contexts:
            need = write_gib(m, context)
            if not fits(need, args.max_gib):
                print(f"{m.name:20s} {context:>8d}  skipped: writing needs ~{need:.1f} GiB > budget", flush=True)
                problems.append(f"{m.name} {context}: skipped (memory)")
                continue
            root = args.dir or tempfile.mkdtemp(prefix="restore-bench-")
            store = os.path.join(root, f"{m.name}-{context}")
            try:
                log(f"[{m.name} {context}] writing ...")
                seq, keys = write_context(m, context, store)
                # what a whole restore reads: every KV page and the last page's state
                read_bytes = len(keys) * PAGE * m.kv_bytes_per_token() + m.state_bytes()
                files, depth = page_paths(m, keys, store)
                for label, frac in buffers:
                    buf = max(PAGE, int(frac * context) // PAGE * PAGE)
                    need = row_gib(m, context, buf)
                    if not fits(need, args.max_gib):
                        print(
                            f"{m.name:20s} {context:>8d} {label:>6s}  skipped: needs ~{need:.1f} GiB > budget",
                            flush=True,
                        )
                        problems.append(f"{m.name} {context} {label}: skipped (memory)")
                        continue
                    log(f"[{m.name} {context}] buffer {label} ({buf} tokens) ...")
                    # Side by side: the store's read of the same pages right before
                    # each restore; medians over --repeat pairs (a shared box is noisy).
                    # The store's read in the restore's own calls (its pieces through this
                    # buffer), right after each restore, where they are smaller than the
                    # store row's: what the same request sizes deliver (like for like).
                    reads, runs, raws, piece_reads = [], [], [], []
                    for _ in range(args.repeat):
                        raws.append(measure_raw_read(files, store, MAX_INFLIGHT * depth))
                        reads.append(measure_store_read(m, keys, store))
                        runs.append(measure_restore(m, seq, store, buf, check_inside_timer=args.check_inside_timer))
                        if runs[-1]["piece_pages"] < READ_BATCH_PAGES:
                            piece_reads.append(measure_store_read(m, keys, store, runs[-1]["piece_pages"]))
                    ok = all(r["pages"] == len(keys) and r["state"] for r in reads)
                    store_gbps = read_bytes / statistics.median(r["wall"] for r in reads) / 1e9 if ok else float("nan")
                    piece_ok = ok and all(r["pages"] == len(keys) and r["state"] for r in piece_reads)
                    piece_gbps = (
                        read_bytes / statistics.median(r["wall"] for r in piece_reads) / 1e9
                        if piece_reads and piece_ok
                        else store_gbps  # the restore's calls were the store row's
                    )
                    raw_gbps = statistics.median(r["bytes"] / r["wall"] for r in raws) / 1e9
                    ours = {
                        "host": runs[0]["host"],
                        "loaded": min(r["loaded"] for r in runs),
                        "wall": statistics.median(r["wall"] for r in runs),
                        "cpu": statistics.median(r["cpu"] for r in runs),
                        "exact": all(r["exact"] for r in runs) if all(r["exact"] is not None for r in runs) else None,
                    }
                    up = None if args.no_upstream else measure_upstream(m, seq, store, buf)
                    total = ours["loaded"] * m.kv_bytes_per_token() + (m.state_bytes() if ours["loaded"] else 0)
                    gbps = total / ours["wall"] / 1e9 if ours["loaded"] else 0.0
                    cpu_gib = ours["cpu"] / (total / 2**30) if total else float("nan")
                    store_cpu_gib = statistics.median(r["cpu"] for r in reads) / (read_bytes / 2**30)
                    ratio = gbps / store_gbps if not math.isnan(store_gbps) else float("nan")
                    vs_piece = gbps / piece_gbps if not math.isnan(piece_gbps) else float("nan")
                    h2d = f" {total / measure_h2d(total) / 1e9:>8.2f}" if args.device == "cuda" and total else ""
                    print(
                        f"{m.name:20s} {context:>8d} {label:>6s} {ours['host']:>8d} {ours['loaded']:>8d} {total:>12d} "
                        f"{ours['wall']:>9.3f} {gbps:>6.2f} {store_gbps:>10.2f} {raw_gbps:>8.2f} {ratio:>6.2f} {gbps / raw_gbps:>7.2f} {cpu_gib:>9.2f} {store_cpu_gib:>9.2f} "
                        f"{ours['exact']!s:>5s} {'-' if up is None else up:>8} "
                        f"{runs[0]['piece_pages']:>10d} {piece_gbps:>10.2f} {vs_piece:>8.2f}{h2d}",
                        flush=True,
                    )
                    if label == "1/16":
                        small.append((context, ratio, ours["loaded"] / len(seq), (up or 0) / len(seq)))
                    if label in guard:
                        if not ours["exact"] or ours["loaded"] != len(seq):
                            problems.append(
                                f"{m.name} {context} {label}: restored {ours['loaded']}, exact {ours['exact']}"
                            )
                        elif not ratio >= guard[label]:
                            problems.append(f"{m.name} {context} {label}: ratio {ratio:.2f} < {guard[label]:.2f}")
            except (ValueError, RuntimeError, MemoryError) as e:
                # e.g. upstream's host-memory check on a machine shared with other jobs
                print(
                    f"{m.name:20s} {context:>8d}  failed: {type(e).__name__}: {str(e)[:120]}",
                    flush=True,
                )
                problems.append(f"{m.name} {context}: failed ({type(e).__name__})")
            finally:
                shutil.rmtree(store, ignore_errors=True)
                if args.dir is None:
                    shutil.rmtree(root, ignore_errors=True)
    if guard:
        # The guard's verdict before the summary line, which stays the last line.
        for p in problems:
            print(f"bench-check FAILED: {p}")
        if not problems:
            want = ", ".join(f"{k} >= {v:.2f}" for k, v in guard.items())
            print(f"bench-check passed: every row exact, restore/store ratio {want}")
    if not small:
        print("restore_vs_store=nan small_buffer_restored=nan upstream_small_buffer_restored=nan")
        return 1
    largest = max(c for c, *_ in small)
    r = min(x for c, x, _, _ in small if c == largest)
    f = min(x for _, _, x, _ in small)
    u = max(x for _, _, _, x in small)
    up = "nan" if args.no_upstream else f"{u:.2f}"
    print(f"restore_vs_store={r:.2f} small_buffer_restored={f:.2f} upstream_small_buffer_restored={up}")
    return 1 if guard and problems else 0


def device_name(device: str) -> str:
    if device == "cuda":
        return f"cuda ({torch.cuda.get_device_name()}, torch {torch.__version__})"
    return f"cpu (the CPU stand-in, torch {torch.__version__})"


def prepare(device: str = "cpu") -> None:
    """What every run of this benchmark (and agent_switch's, stall_bench's) sets up
    first: the device the stacks use (`cpu`: the CPU switch; `cuda`: a GPU, through
    SGLANG_L3_TEST_DEVICE, which every HybridSpec reads), the hicache and storage
    patches, upstream's host reserve lowered to 1 GiB and one intra-op thread;
    warnings and library logging off."""
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    os.environ["SGLANG_L3_TEST_DEVICE"] = device
    from sglang_l3.testing.device import DeviceUnavailable, stack_device

    try:
        on = stack_device()
    except DeviceUnavailable as e:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: --device {device}: {e}") from None
    if on == "cpu":
        import sglang_l3.cpu

        sglang_l3.cpu.enable()
    from sglang_l3.patches import framework

    framework.apply_all([s for s in framework.load_series() if s.group in ("hicache", "storage")])
    import sglang.srt.mem_cache.pool_host.base as host_base

    # Upstream keeps 10 GiB of host RAM free for the serving process; this benchmark
    # is the only process, and its own budget is --max-gib.
    host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 1 << 30
    # One intra-op thread: the host->device copy stands in for a DMA, and the other
    # cores belong to the store's readers (on a 2-core box, 2 OpenMP threads made
    # the copies ~5x slower in CPU time when the store's threads ran alongside).
    torch.set_num_threads(1)


def parse_min_ratio(text: str) -> dict[str, float]:
    """'1/16=0.275,1/4=0.4' -> {'1/16': 0.275, '1/4': 0.4}; buffers from BUFFERS only."""
    out: dict[str, float] = {}
    labels = [b for b, _ in BUFFERS]
    for part in text.split(","):
        label, sep, value = part.partition("=")
        try:
            floor = float(value)
        except ValueError:
            floor = math.nan
        if not sep or label.strip() not in labels or not floor >= 0:
            raise SystemExit(f"--min-ratio: {part!r} is not BUF=R with BUF one of {', '.join(labels)} and R >= 0")
        out[label.strip()] = floor
    return out


if __name__ == "__main__":
    sys.exit(main())
