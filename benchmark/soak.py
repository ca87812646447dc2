"""Soak: a randomized buffer-only hybrid L3 workload through the real scheduler
admission path on CPU (≥ 2,000 requests by default), checking the re-anchor
invariants after every step. Not a timed test; prints counts.

    .venv/bin/python benchmark/soak.py --requests 2000 --seed 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--tree-core", default="rust", choices=["rust", "python"])
    ap.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    args = ap.parse_args()
    os.environ.setdefault("SGLANG_L3_VERIFY", "1")
    import sglang_l3.cpu

    sglang_l3.cpu.enable()
    import sglang_l3.plugin

    sglang_l3.plugin.register()
    from sglang_l3.testing.soak import run_soak

    store = args.store or tempfile.mkdtemp(prefix="sglang-l3-soak-")
    t0 = time.monotonic()

    def progress(rep, step):
        print(
            f"  step {step}: {rep.requests} requests, {rep.restores} restores, {len(rep.violations)} violations",
            flush=True,
        )

    rep = run_soak(
        args.requests, store, seed=args.seed, page_size=args.page_size, tree_core=args.tree_core, progress=progress
    )
    print(
        f"soak: {args.requests} requests, seed {args.seed}, page {args.page_size}, "
        f"tree core {args.tree_core}, SGLANG_L3_VERIFY={os.environ['SGLANG_L3_VERIFY']}, "
        f"{time.monotonic() - t0:.0f}s"
    )
    for line in rep.lines():
        print("  " + line)
    for v in rep.violations[:10]:
        print("  VIOLATION " + v)
    return 1 if rep.violations or rep.leaked else 0


if __name__ == "__main__":
    sys.exit(main())
