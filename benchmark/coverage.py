"""Restorable coverage of L3 under a seeded multi-agent workload (issue 7).

Agents share a system prompt, take long and short turns, sometimes branch off an
earlier point of their history; device memory is evicted between turns. Every
request runs through the real scheduler admission path (SchedulerHarness,
page_size 1, chunked prefill) over the real UnifiedRadixCache + buffer-only
HiCache + our L3 store. Then a fresh process (new L3Stack over the same
directory) replays every prompt's prefetch.

Prints, with the `branch-backup` patch and with it undone, side by side:
KV bytes and Mamba-state bytes in L3, restorable coverage (KV bytes at or
before a stored state of the same prefix; target >= 0.99) and the replay hit
rate in a fresh process for new conversations that share each prompt up to a
random point (tokens restored / shared tokens; the restore is bounded by the
deepest stored state at or before the cut, so < 1 is expected).

    .venv/bin/python benchmark/coverage.py [--agents 16] [--turns 4] [--seed 7]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from dataclasses import dataclass

os.environ.setdefault("SGLANG_L3_PUBLISH_STATS", "0")


@dataclass
class Result:
    label: str
    requests: int
    kv_bytes: int
    state_bytes: int
    coverage: float
    exact: bool
    restored: int
    prompt_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.restored / self.prompt_tokens if self.prompt_tokens else 0.0


def _workload(seed: int, agents: int, turns: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 30000) for _ in range(192)]
    hist = [list(system) for _ in range(agents)]
    prompts: list[list[int]] = []
    for _ in range(turns):
        for a in rng.sample(range(agents), agents):
            h = hist[a]
            if len(h) > len(system) + 8 and rng.random() < 0.25:
                h = h[: rng.randrange(len(system), len(h))]  # branch off an earlier point
            n = rng.randint(200, 420) if rng.random() < 0.3 else rng.randint(4, 40)
            prompt = h + [rng.randrange(1, 30000) for _ in range(n)]
            if len(prompt) > 1800:
                prompt = system + prompt[-64:]
            prompts.append(prompt)
            hist[a] = prompt + [7]  # the sampled answer token (harness finish) joins the history
    return prompts


def _run(label: str, prompts: list[list[int]], seed: int, store_dir: str) -> Result:
    from sglang_l3.testing.coverage import restorable_coverage
    from sglang_l3.testing.scheduler_harness import SchedulerHarness
    from sglang_l3.testing.stack import HybridSpec, L3Stack

    rng = random.Random(seed + 1)
    spec = HybridSpec(page_size=1, kv_size=4096, max_context_len=2048, mamba_cache_size=64)
    extra = {"hicache_storage_pass_prefix_keys": True}  # prior links for exact coverage
    with L3Stack(spec, store_dir, extra_config=extra) as st:
        h = SchedulerHarness(st, chunked_prefill_size=256)
        for i, p in enumerate(prompts):
            h.serve(h.make_req(p, rid=f"{label}{i}"))
            st.flush_backups()
            if rng.random() < 0.6:
                st.evict_all()
    cov = restorable_coverage(store_dir)
    restored = shared = 0
    with L3Stack(spec, store_dir, extra_config=extra) as fresh:
        for i, p in enumerate(prompts):
            # A new conversation sharing this prompt up to a random earlier point.
            cut = rng.randrange(1, len(p) + 1)
            shared += cut
            hnd, n = fresh.prefetch(p[:cut] + [30001 + i, 30002, 30003], f"replay{i}")
            restored += n
            if fresh.cache.buffer_pipeline.has_staged(hnd):
                fresh.cache.buffer_pipeline.release_staged_hold(hnd, reason="bench_replay")
            fresh.evict_all()
    return Result(label, len(prompts), cov.kv_bytes, cov.state_bytes, cov.fraction, cov.exact, restored, shared)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    import sglang_l3.cpu

    sglang_l3.cpu.enable()
    import sglang_l3.plugin

    sglang_l3.plugin.register()
    from sglang_l3.patches import framework

    prompts = _workload(args.seed, args.agents, args.turns)
    results = []
    for label in ("patched", "upstream"):
        if label == "upstream":
            framework.undo("branch-backup")
        with tempfile.TemporaryDirectory(prefix=f"l3cov-{label}-") as d:
            results.append(_run(label, prompts, args.seed, d))
    print(
        f"workload: {args.agents} agents x {args.turns} turns = {len(prompts)} requests, "
        f"seed {args.seed}, page_size 1, chunked prefill 256"
    )
    print(f"{'':10} {'KV MiB':>8} {'state MiB':>10} {'state/KV':>9} {'coverage':>9} {'exact':>6} {'replay hit':>11}")
    for r in results:
        print(
            f"{r.label:10} {r.kv_bytes / 2**20:8.2f} {r.state_bytes / 2**20:10.2f} "
            f"{r.state_bytes / max(r.kv_bytes, 1):9.3f} {r.coverage:9.4f} {str(r.exact):>6} {r.hit_rate:11.4f}"
        )
    ok = results[0].coverage >= 0.99
    print(f"restorable coverage target >= 0.99: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
