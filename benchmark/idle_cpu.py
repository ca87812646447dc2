"""CPU an idle server uses, with and without `--sleep-on-idle`, side by side.

Starts the e2e tests' CPU server (packaged tiny Qwen3-Next, buffer-only HiCache
over the file L3 store) twice, one after the other: busy loop (upstream's
default) and `--sleep-on-idle` (`ServerConfig.sleep_on_idle`, the launcher's
default). Each gets one request (a prompt written to L3), a settle pause, then
`--window` seconds of idleness, over which the server's processes' user+sys CPU
seconds are read (`Server.cpu_seconds`: launcher, tokenizer, scheduler ranks,
detokenizer, all threads), and the rank-0 scheduler's main thread is sampled
every 0.2 s (`sglang_l3.testing.idle.observe`: asleep = blocked in poll). CPU
time, not wall time. Part of it is torch's gloo transport loops (a 10 ms epoll
tick per process group, whatever the server does; `sglang_l3.testing.idle`),
reported apart: C is the sleeping server's CPU without them. Last line:

    busy_core_fraction=A sleep_core_fraction=B ratio=A/B sleep_without_gloo=C

    nice -n 10 .venv/bin/python benchmark/idle_cpu.py [--window 60] [--tp 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=60.0, help="idle seconds measured")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after the request before measuring")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--work", default=None, help="logs and stores (default: a temporary directory)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    args = ap.parse_args()

    from sglang_l3.testing.idle import observe
    from sglang_l3.testing.server import Server, ServerConfig, prompt, warm_hicache_hash_extension

    warm_hicache_hash_extension()
    work = Path(args.work or tempfile.mkdtemp(prefix="idle-cpu-"))
    fractions: dict[str, float] = {}
    own: dict[str, float] = {}  # the same without gloo's transport loops
    for label, sleep in (("busy", False), ("sleep", True)):
        cfg = ServerConfig(
            storage_dir=str(work / label / "store"),
            tp_size=args.tp,
            chunked_prefill_size=256,
            page_size=64,
            prefetch_threshold=64,
            sleep_on_idle=sleep,
        )
        with Server(cfg, work / label / "server.log", startup_timeout=args.startup_timeout) as s:
            s.generate(prompt(1, 400), 8)
            time.sleep(args.settle)
            obs = observe(s, args.window)
        fractions[label], own[label] = obs.core_fraction, obs.own_core_fraction
        print(f"{label:5s} (--sleep-on-idle {'on' if sleep else 'off'}, TP={args.tp}): {obs}", flush=True)
    busy, asleep = fractions["busy"], fractions["sleep"]
    print(
        f"busy_core_fraction={busy:.3f} sleep_core_fraction={asleep:.4f} ratio={busy / max(asleep, 1e-6):.0f} "
        f"sleep_without_gloo={own['sleep']:.4f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
