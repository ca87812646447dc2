"""Fixed latency of a small L3 restore (<= 4 MiB: `make demo`'s agents) on the
real cache stack on CPU, before and after issue 15's cuts, side by side in one
run (rounds interleaved, so machine load hits both alike):

  before: the harness's scheduler loop polls HiCache events every 2 ms
  after:  every 0.5 ms (testing.stack.PUMP_PERIOD_S)

A restore waits on that loop twice (the host bounce for a storage hit is
allocated on the scheduler thread; the staged hit is picked up by it). The rest
of the fixed latency is upstream's thread hand-offs (scheduler -> prefetch
thread -> scheduler -> IO thread -> the store's IO pool -> ack thread ->
scheduler) and the per-layer host->device copy; on a loaded machine each
hand-off waits for a CPU.

    .venv/bin/python benchmark/restore_latency.py [--rounds 6] [--agents 4] [--first N]

--first N also measures the first restore of a fresh process (N processes each,
alternating), with and without patch eager-page-hash: without it that restore
also loads HiCache's page-hash extension inside the prefetch thread.

Prints p50 / p90 ms per restore for each and the ratio. The timer covers
`L3Stack.restore` without the test harness's forward-time read
(`check_forward=False`, issue 34): prefetch, staging, admission, the forward
pass's per-layer waits, the ack. Every restore is checked bit-exact against the
written state after its timer stops; a mismatch aborts.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Iterator
from time import perf_counter


@contextlib.contextmanager
def before() -> Iterator[None]:
    from sglang_l3.testing import stack

    saved = stack.PUMP_PERIOD_S
    stack.PUMP_PERIOD_S = 0.002
    try:
        yield
    finally:
        stack.PUMP_PERIOD_S = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    ap.add_argument(
        "--first",
        type=int,
        default=0,
        help="fresh processes per variant for the first-restore figure",
    )
    ap.add_argument("--one-first", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.first:
        _first_restores(args.first)
    import sglang_l3.cpu

    sglang_l3.cpu.enable()
    import sglang_l3.plugin

    sglang_l3.plugin.register()
    import sglang.srt.mem_cache.pool_host.base as pool_host_base

    # the pools here take < 0.1 GB; upstream's 10 GiB host reserve would refuse
    # them on a shared machine with less than that free, which says nothing
    # about restore latency
    pool_host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 2**30
    from sglang_l3.testing.demo import (
        SMALL_RESTORE_BYTES,
        agent_contexts,
        restored_bytes,
    )
    from sglang_l3.testing.stack import HybridSpec, L3Stack

    if args.one_first:  # child of --first: one write, evict, one timed restore
        with L3Stack(
            HybridSpec(page_size=64, kv_size=16384, max_context_len=8192, mamba_cache_size=64),
            args.store or _tmp_store(),
        ) as st:
            seq = next(iter(agent_contexts(1, 64, 512).values()))
            st.write(seq)
            st.evict_all()
            t0 = perf_counter()
            req, _ = st.restore(seq, "first", check_forward=False)
            print(f"FIRST {perf_counter() - t0:.6f}")
            st.release(req)
        return 0

    spec = HybridSpec(page_size=64, kv_size=16384, max_context_len=8192, mamba_cache_size=64)
    ctxs = agent_contexts(args.agents, 64, 512)
    store = args.store or _tmp_store()
    times: dict[str, list[float]] = {"before": [], "after": []}
    with L3Stack(spec, store) as st:
        for i, seq in enumerate(ctxs.values()):
            st.write(seq, marker=float(i + 1))
            st.evict_all()
        snaps = {}
        for (
            name,
            seq,
        ) in ctxs.items():  # warm-up restore (one-off costs) and the reference state
            st.evict_all()
            req, _ = st.restore(seq, f"warm-{name}")
            m = st.match(seq)
            snaps[name] = st.snapshot(m.last_device_node, int(req.kv.mamba_pool_idx))
            st.release(req)
        sizes = []
        for rnd in range(args.rounds):
            for label in ("before", "after") if rnd % 2 == 0 else ("after", "before"):
                with before() if label == "before" else contextlib.nullcontext():
                    for name, seq in ctxs.items():
                        st.evict_all()
                        st.scribble()
                        t0 = perf_counter()
                        req, loaded = st.restore(seq, f"{label}-{rnd}-{name}", check_forward=False)
                        dt = perf_counter() - t0
                        m = st.match(seq)
                        if not st.snapshot(m.last_device_node, int(req.kv.mamba_pool_idx)).equal(snaps[name]):
                            raise SystemExit(f"{label} {name}: restore not bit-exact")
                        sizes.append(restored_bytes(st, loaded))
                        st.release(req)
                        times[label].append(dt)
    if max(sizes) > SMALL_RESTORE_BYTES:
        print(f"note: largest restore {max(sizes) / 2**20:.1f} MiB is above 4 MiB")
    n = len(times["after"])
    print(
        f"restore latency, {n} restores each of {min(sizes) / 2**20:.1f}-{max(sizes) / 2**20:.1f} MiB "
        f"contexts (KV + Mamba state), bit-exact:"
    )
    for label, xs in times.items():
        xs = sorted(xs)
        print(
            f"  {label:6s}: p50 {statistics.median(xs) * 1e3:6.1f} ms   p90 {xs[int(0.9 * (len(xs) - 1))] * 1e3:6.1f} ms"
        )
    ratio = statistics.median(times["before"]) / statistics.median(times["after"])
    print(f"  p50 before / after: {ratio:.2f}x")
    return 0


def _tmp_store() -> str:
    """A temporary store, removed when this process exits."""
    import atexit
    import shutil

    path = tempfile.mkdtemp(prefix="sglang-l3-latency-")
    atexit.register(shutil.rmtree, path, True)
    return path


def _first_restores(n: int) -> None:
    import os
    import subprocess

    out: dict[str, list[float]] = {"with eager-page-hash": [], "without": []}
    for i in range(2 * n):
        label = "with eager-page-hash" if i % 2 == 0 else "without"
        env = dict(
            os.environ,
            SGLANG_L3_DISABLE="" if label.startswith("with ") else "eager-page-hash",
        )
        r = subprocess.run(
            [sys.executable, __file__, "--one-first"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=900,
        )
        line = next((x for x in r.stdout.splitlines() if x.startswith("FIRST ")), None)
        if line is None:
            raise SystemExit(f"first-restore child failed:\n{r.stderr[-2000:]}")
        out[label].append(float(line.split()[1]))
    print(f"first restore of a fresh process, {n} processes each (median):")
    for label, xs in out.items():
        print(f"  {label:21s}: {statistics.median(xs) * 1e3:6.1f} ms  [{min(xs) * 1e3:.0f}..{max(xs) * 1e3:.0f}]")
    ratio = statistics.median(out["without"]) / statistics.median(out["with eager-page-hash"])
    print(f"  without / with: {ratio:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
