#!/usr/bin/env python3
"""Restore speed of a hybrid context: `file` (sglang-l3's NVMe store) vs `mooncake`.

Runs the real upstream cache stack on CPU (UnifiedRadixCache +
HybridCacheController + buffer_only, every sglang-l3 patch applied;
sglang_l3.testing.stack) once per backend, side by side in one run, and times
for each context size:
  write    the write-through to L3 until drained (the harness's KV fill, the
           insert and its reference snapshot run before the timer);
  restore  L3 -> host staging -> device -> ack (prefetch_from_storage,
           init_load_back, the forward pass's per-layer waits), the path a
           request hitting L3 takes, without the test harness's forward-time
           read (issue 34); every restore is checked bit-exact (KV and Mamba
           state) after its timer stops, before it counts.
The KV is Qwen3-Next-80B-like per token (12 attention layers x 2 KV heads x
256 dim x bf16 = 24 KiB/token); the Mamba state is small (tiny model shape).

`mooncake` joins a store given by --master (e.g. a master on your network:
`--master 10.0.0.5:50051 --protocol tcp --local-hostname <this host's IP>`)
or, without it, a loopback master + storage node started here and stopped by
PID at the end (sglang_l3.testing.mooncake). On loopback the figures measure
the software path, not a network. Not a test: numbers only. The last line is

  restore_mooncake_vs_file=R1 write_mooncake_vs_file=R2   (time ratios, > 1 = slower)

Example: python benchmark/restore_bench_mooncake.py --tokens 1024,4096 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BYTES_PER_TOKEN = 12 * 2 * 2 * 256 * 2


def log(msg: str) -> None:
    print(msg, flush=True)


def setup() -> None:
    import sglang_l3.cpu
    import sglang_l3.plugin
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    sglang_l3.cpu.enable()
    _load_native_hash_module()
    sglang_l3.plugin.register()


def spec(tokens: int, page_size: int) -> Any:
    from sglang_l3.testing.stack import HybridSpec

    full = tuple(range(3, 48, 4))  # 12 of 48 layers, Qwen3-Next's 1:3 ratio
    return HybridSpec(
        page_size=page_size,
        num_layers=48,
        full_attention_layer_ids=full,
        head_num=2,
        head_dim=256,
        kv_size=tokens + 2 * page_size,
        max_context_len=tokens + 2 * page_size,
    )


def measure(
    backend: str,
    extra: dict[str, Any],
    workdir: str,
    tokens: int,
    page_size: int,
    repeats: int,
) -> tuple[float, float]:
    """(median write seconds, median restore seconds) for one context size."""
    import psutil
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang_l3.testing.stack import L3Stack

    writes, restores = [], []
    # Book the (small) host pools against free RAM: upstream otherwise keeps a
    # 10 GiB reserve (pool_host/base.py), more than a busy small machine has.
    with (
        host_memory_budget_scope(psutil.virtual_memory().available // 2),
        L3Stack(
            spec(tokens, page_size),
            workdir,
            storage_backend=backend,
            extra_config=extra,
        ) as st,
    ):
        for r in range(repeats):
            seq = list(range(1 + r * 7919, 1 + r * 7919 + tokens))  # a fresh context each round
            # Timed: the write-through to L3 only (fill_kv, the insert and the
            # reference snapshot are the harness standing in for a forward pass).
            want = st.write(seq, marker=float(r + 1), flush=False)
            t0 = time.perf_counter()
            st.flush_backups()
            writes.append(time.perf_counter() - t0)
            st.evict_all()
            st.scribble()
            t0 = time.perf_counter()
            req, loaded = st.restore(seq, f"bench-{r}", check_forward=False)
            restores.append(time.perf_counter() - t0)
            m = st.match(seq)
            if loaded != tokens or not st.snapshot(m.last_device_node, int(req.kv.mamba_pool_idx)).equal(want):
                raise SystemExit(f"{backend}: restore of {tokens} tokens was not exact (loaded {loaded})")
            st.release(req)
            st.evict_all()
    return statistics.median(writes), statistics.median(restores)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096", help="comma-separated context sizes")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--store-dir",
        default=None,
        help="file store directory (default: a temporary one)",
    )
    ap.add_argument(
        "--master",
        default=None,
        help="existing mooncake_master HOST:PORT (default: start one here)",
    )
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--metadata-server", default="P2PHANDSHAKE")
    ap.add_argument("--local-hostname", default="127.0.0.1")
    ap.add_argument(
        "--segment-size",
        default="2gb",
        help="memory this process lends the store with --master (local store: a storage node's)",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.tokens.split(",") if x]
    setup()
    from sglang_l3.testing import mooncake as mc

    reason = mc.unavailable_reason()
    if reason:
        log(f"mooncake unavailable: {reason}")
        return 2
    rows: list[tuple[int, float, float, float, float]] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="restore-bench-")))
        if args.master:
            extra = {
                "master_server_address": args.master,
                "protocol": args.protocol,
                "metadata_server": args.metadata_server,
                "local_hostname": args.local_hostname,
                "global_segment_size": args.segment_size,
            }
        else:
            seg = max(2 * max(sizes) * BYTES_PER_TOKEN * args.repeats, 512 << 20)
            cluster = stack.enter_context(mc.MooncakeCluster(tmp / "mooncake", segment_size=f"{seg >> 20}MB"))
            extra = cluster.extra_config()
        for n in sizes:
            fdir = args.store_dir or str(tmp / f"file-{n}")
            fw, fr = measure("file", {}, fdir, n, args.page_size, args.repeats)
            mw, mr = measure("mooncake", extra, str(tmp / "unused"), n, args.page_size, args.repeats)
            rows.append((n, fw, fr, mw, mr))
    log(
        f"{'tokens':>7} {'MiB':>7} | {'file write':>10} {'restore':>8} {'GB/s':>6} | "
        f"{'mooncake write':>14} {'restore':>8} {'GB/s':>6} | restore ratio"
    )
    for n, fw, fr, mw, mr in rows:
        gb = n * BYTES_PER_TOKEN / 1e9
        log(
            f"{n:>7} {n * BYTES_PER_TOKEN / (1 << 20):>7.1f} | {fw * 1e3:>8.0f}ms {fr * 1e3:>6.0f}ms {gb / fr:>6.2f} | "
            f"{mw * 1e3:>12.0f}ms {mr * 1e3:>6.0f}ms {gb / mr:>6.2f} | {mr / fr:>6.2f}x"
        )
    r_restore = statistics.median(mr / fr for _, _, fr, _, mr in rows)
    r_write = statistics.median(mw / fw for _, fw, _, mw, _ in rows)
    log(f"restore_mooncake_vs_file={r_restore:.2f} write_mooncake_vs_file={r_write:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
