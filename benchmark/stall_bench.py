#!/usr/bin/env python3
"""Decode stall during a streamed L3 restore: one request decodes while another's long
context streams back from L3 through a small host buffer (issue 22, item 6).

Why the cache-stack harness and not a CPU server: the stall comes from the scheduler
thread copying a landed piece host -> device. On a GPU that copy is a DMA on
upstream's load stream; a CPU server has no asynchronous device (torch.cpu streams do
nothing), so every copy is synchronous there whatever the patch does. The harness runs
the real upstream cache stack (UnifiedRadixCache + HybridCacheController + buffer-only
HiCache + our store) at one TP=2 rank's Qwen3-Next-80B-A3B sizes (benchmark/restore_bench.py),
on the simulated device in threaded mode (`sglang_l3.sim.harness`): a device thread runs
what is queued on the load stream, as a copy engine does, beside the scheduler thread.

The scheduler loop stand-in ticks once per decode step of request A: upstream's
`check_hicache_events` (our `_tick` lands pieces in it), the poll of request B's
prefetch, then A's decode forward on the scheduler thread (a fixed matmul workload,
~--decode-ms, plus A's next KV row). A's inter-token gap is one tick. Three runs over
the same store, each --repeat restores of B long:

- `no restore`: A decodes alone (the reference);
- `restore, sync device`: plain torch.cpu, where a piece copy runs inside
  `_copy_to_device` on the scheduler thread (what every copy was before issue 22);
- `restore, async device`: the simulated device with its device thread: the copy is
  queued on the load stream and the scheduler moves on.

Gaps are measured from B's prefetch start until B is staged (the streaming rounds);
B is then admitted and checked bit-exact, outside every timed gap (the harness's
admission and its checks never fall in a gap: issue 34). Printed per run: gap p50/p99/max, the
number of ticks, the longest time the scheduler thread spent issuing piece copies
(`_copy_to_device`) in one tick, wall and CPU, and the device->host index reads the
simulated device counted (async run only; each waits for the device, as a `.cpu()` of
device indices does on a GPU). The last line is exactly

  gap_p99_ms=G gap_p99_no_restore_ms=N gap_p99_sync_ms=S stall_p99_ms=A stall_max_ms=B copy_issue_max_ms=C device_index_reads=D

for the async-device run: G its gap p99, beside the no-restore run's (N) and the
synchronous path's (S); A and B = its gap p99 and max minus the no-restore run's median
gap (the extra wait a decoding request sees); C = the longest wall time the scheduler
thread spent issuing piece copies in one tick (on the simulated device: queueing, index
snapshots, and any device->host index read's wait; not the copy itself, which runs on
the device thread); D = device->host index reads during the run (upstream's load-back
at admission reads its own; none per piece since issue 33).
`--read-device-indices` hands each piece copy R's device indices instead of their host
copy (issue 33's fix reverted: a device sync per piece), to show what that costs.
`--device cuda` (a CUDA/ROCm GPU) runs the stacks there: A's forward workload is a
matmul on the GPU, waited for at the end of each step (the scheduler reads the sampled
token), and the restore runs on upstream's real load stream; the runs are `no restore`
and `restore, cuda device` (no simulator, no synchronous CPU path: the last line's
gap_p99_sync_ms prints nan, and device_index_reads the -1 of "not counted").
Not a test: numbers only.

Example: nice -n 10 python benchmark/stall_bench.py --context 65536 --buffer 0.25
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from restore_bench import (  # noqa: E402
    MODELS,
    PAGE,
    buffer_args,
    device_name,
    free_memory,
    host_budget,
    hybrid_spec,
    prepare,
    touch_host_pools,
)

A_CONTEXT = 512  # request A's prefix (resident), it decodes after that


@dataclass
class Run:
    name: str
    gaps: list[float] = field(default_factory=list)  # seconds, while B streams
    copy_in_tick: list[float] = field(default_factory=list)  # wall seconds issuing piece copies per tick
    copy_cpu_in_tick: list[float] = field(default_factory=list)  # the scheduler thread's CPU seconds in it
    device_reads: int = 0  # device->host index reads the simulated device counted (async run; -1: not counted)
    exact: bool = True
    pieces: int = 0

    def pct(self, q: float) -> float:
        g = sorted(self.gaps)
        return g[min(len(g) - 1, int(q * len(g)))] if g else 0.0


class Decoder:
    """Request A's decode steps: a fixed forward workload + its next KV row."""

    def __init__(self, st: Any, steps: int, reps: int) -> None:
        self.st = st
        self.rows = st.allocator.alloc((A_CONTEXT + steps + PAGE) // PAGE * PAGE)
        self.ids = [(i * 31) % 50_000 + 7 for i in range(len(self.rows))]
        st.fill_kv(self.rows[:A_CONTEXT], self.ids[:A_CONTEXT], 0)
        self.pos = A_CONTEXT
        self.x = torch.randn(512, 512, device=st.spec.device)
        self.reps = reps

    def step(self) -> None:
        y = self.x
        for _ in range(self.reps):
            y = torch.tanh(y @ self.x)
        if y.is_cuda:
            torch.cuda.synchronize()  # the scheduler waits for the sampled token
        i = self.pos % len(self.rows)
        self.st.fill_kv(self.rows[i : i + 1], self.ids[i : i + 1], self.pos)
        self.pos += 1

    def close(self) -> None:
        self.st.allocator.free(self.rows)


def calibrate(ms: float, device: str = "cpu") -> int:
    """Matmul steps that take ~`ms` on `device` (once, so every run does the same work)."""
    x = torch.randn(512, 512, device=device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        y = x
        for _ in range(10):
            y = torch.tanh(y @ x)
        if y.is_cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / 10)
    return max(1, int(ms / 1000 / best))


def run(
    name: str, spec: Any, store: str, seq: list[int], buffer_tokens: int, args: Any, *, restore: bool, device: str
) -> Run:
    import sglang_l3.patches.hicache.streamed_restore as sr
    from sglang_l3.sim import streams as sim_streams
    from sglang_l3.sim.harness import simulated_device
    from sglang_l3.testing.stack import L3Stack

    out = Run(name)
    copy = sr._copy_to_device
    tick_copy = [0.0, 0.0]

    def timed_copy(cc: Any, host: Any, rows: Any, rows_host: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return copy(cc, host, rows, None if args.read_device_indices else rows_host)
        finally:
            tick_copy[0] += time.perf_counter() - t0
            tick_copy[1] += time.thread_time() - c0
            out.pieces += 1

    sim = simulated_device(args.seed, threaded=True) if device == "async" else None
    if sim is not None:
        sim.__enter__()
    sr._copy_to_device = timed_copy
    try:
        with L3Stack(spec, store, server_args=buffer_args(spec, buffer_tokens), host_budget_bytes=host_budget()) as st:
            cc = st.cache.cache_controller
            cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)
            st.check_forward_kv = False  # B is compared below, once
            touch_host_pools(cc)
            dec = Decoder(st, args.steps * (args.repeat + 1), args.reps)
            for r in range(args.repeat):
                _one(st, dec, seq, out, tick_copy, restore=restore, steps=args.steps, rid=f"B{r}")
            dec.close()
            if sim is not None:
                out.device_reads = sim_streams.stats()["device_reads"]
            elif device == "cuda":
                out.device_reads = -1
            del st
    finally:
        sr._copy_to_device = copy
        if sim is not None:
            sim.__exit__(None, None, None)
    free_memory()
    return out


def _one(st: Any, dec: Decoder, seq: list[int], out: Run, tick_copy: list, *, restore: bool, steps: int, rid: str):
    cache = st.cache
    bp = cache.buffer_pipeline
    h = st.start_prefetch(seq, rid) if restore else None
    last = time.perf_counter()
    n = 0
    deadline = time.monotonic() + 3600
    while True:
        tick_copy[0] = tick_copy[1] = 0.0
        cache.check_hicache_events()
        staged = h is not None and cache.check_prefetch_progress(h) and bp.has_staged(h)
        dec.step()
        now = time.perf_counter()
        if not staged:
            out.gaps.append(now - last)
            out.copy_in_tick.append(tick_copy[0])
            out.copy_cpu_in_tick.append(tick_copy[1])
        last = now
        n += 1
        if (h is None and n >= steps) or staged:
            break
        if time.monotonic() > deadline:
            raise RuntimeError("B did not stage")
    if h is None:
        return
    cache.pop_prefetch_loaded_tokens(h)
    req, loaded = st.admit(h, seq, rid)
    k, _ = st.expected_kv(seq)
    out.exact = out.exact and loaded == len(seq) and bool(st.snapshot(st.match(seq).last_device_node, None).k.equal(k))
    st.release(req)
    st.evict_all()
    st.settle()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODELS[0].name, choices=[m.name for m in MODELS])
    ap.add_argument("--context", type=int, default=65536, help="tokens of request B's context in L3")
    ap.add_argument("--buffer", type=float, default=0.25, help="host staging buffer as a fraction of B's context")
    ap.add_argument("--decode-ms", type=float, default=20.0, help="request A's forward workload per token")
    ap.add_argument("--steps", type=int, default=60, help="decode steps of the no-restore run per repeat")
    ap.add_argument("--repeat", type=int, default=3, help="restores of B per run")
    ap.add_argument("--seed", type=int, default=1, help="simulated device seed")
    ap.add_argument("--dir", default=None, help="store directory (default: a temp dir, removed)")
    ap.add_argument(
        "--read-device-indices",
        action="store_true",
        help="negative control: piece copies read R's device indices to host (issue 33's fix reverted)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: the CPU stand-in (synchronous and simulated asynchronous device); cuda: a CUDA/ROCm GPU",
    )
    args = ap.parse_args(argv)

    # restore_bench's set-up: the device, the patches, upstream's host reserve lowered,
    # one intra-op thread (the copy engine and the scheduler each get one core)
    prepare(args.device)
    args.reps = calibrate(args.decode_ms, args.device)

    from sglang_l3.testing.stack import L3Stack

    m = next(x for x in MODELS if x.name == args.model)
    spec = hybrid_spec(m, args.context)
    spec = replace(spec, kv_size=spec.kv_size + A_CONTEXT + args.steps * (args.repeat + 1) + 4 * PAGE)
    buffer_tokens = int(args.context * args.buffer)
    store = args.dir or tempfile.mkdtemp(prefix="stall-bench-")
    seq = [(i * 7919) % 150_000 + 1 for i in range(args.context)]
    try:
        with L3Stack(
            spec, store, server_args=buffer_args(spec, args.context // 4), host_budget_bytes=host_budget()
        ) as w:
            w.write(seq, marker=2.0)
            w.settle(timeout=3600)
        free_memory()
        if args.device == "cuda":
            runs = [
                run("no restore", spec, store, seq, buffer_tokens, args, restore=False, device="cuda"),
                run("restore, cuda device", spec, store, seq, buffer_tokens, args, restore=True, device="cuda"),
            ]
        else:
            runs = [
                run("no restore", spec, store, seq, buffer_tokens, args, restore=False, device="sync"),
                run("restore, sync device", spec, store, seq, buffer_tokens, args, restore=True, device="sync"),
                run("restore, async device", spec, store, seq, buffer_tokens, args, restore=True, device="async"),
            ]
    finally:
        if args.dir is None:
            shutil.rmtree(store, ignore_errors=True)

    piece = int(buffer_tokens * 0.4) // PAGE * PAGE
    print(
        f"# {m.name} one TP=2 rank: B = {args.context} tokens in L3, host buffer {buffer_tokens} tokens "
        f"(pieces of ~{piece} tokens, {piece * m.kv_bytes_per_token() / 2**20:.0f} MiB), A decodes with "
        f"~{args.decode_ms:g} ms of forward work per token; {args.repeat} restores per run; torch threads 1; "
        f"device {device_name(args.device)}"
        + ("; piece copies read device indices (--read-device-indices)" if args.read_device_indices else "")
    )
    print(
        f"{'run':24s} {'ticks':>6s} {'gap_p50_ms':>10s} {'gap_p99_ms':>10s} {'gap_max_ms':>10s} "
        f"{'copy_issue_max_ms':>17s} {'copy_cpu_max_ms':>15s} {'pieces':>6s} {'d2h_reads':>9s} {'exact':>5s}"
    )
    for r in runs:
        print(
            f"{r.name:24s} {len(r.gaps):6d} {1e3 * statistics.median(r.gaps):10.1f} {1e3 * r.pct(0.99):10.1f} "
            f"{1e3 * max(r.gaps):10.1f} {1e3 * max(r.copy_in_tick, default=0.0):17.2f} "
            f"{1e3 * max(r.copy_cpu_in_tick, default=0.0):15.2f} {r.pieces:6d} {r.device_reads:9d} {str(r.exact):>5s}"
        )
    base = statistics.median(runs[0].gaps)
    a = runs[-1]
    sync = f"{1e3 * runs[1].pct(0.99):.1f}" if len(runs) == 3 else "nan"
    print(
        f"gap_p99_ms={1e3 * a.pct(0.99):.1f} gap_p99_no_restore_ms={1e3 * runs[0].pct(0.99):.1f} "
        f"gap_p99_sync_ms={sync} "
        f"stall_p99_ms={1e3 * (a.pct(0.99) - base):.1f} stall_max_ms={1e3 * (max(a.gaps) - base):.1f} "
        f"copy_issue_max_ms={1e3 * max(a.copy_in_tick, default=0.0):.2f} device_index_reads={a.device_reads}"
    )
    return 0 if all(r.exact for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
