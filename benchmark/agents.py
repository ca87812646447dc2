"""N agents taking turns over one server: "speaks next" hints and L3 session
retention (issue 13), measured side by side in one run.

Real servers (`sglang_l3.testing.server`, the packaged tiny Qwen3-Next on CPU
unless --device cuda), buffer-only HiCache over the sglang-l3 `file` store.
Each agent has a long context; every turn appends a new user message to its
history + last answer. The device pool holds about one agent's context, so a
returning agent's context comes back from L3. Between turns the framework
"thinks" for --think seconds (identical in every run).

Runs:
  cold      no hints: each turn >= 2 restores its context from L3 on arrival
  hinted    when an agent has answered, the framework hints the next speaker
            (POST /sglang_l3/prefetch with its session_id) before thinking
  capped    byte-capped store (--cap-contexts x one context) with one-off
            "noise" prompts between turns, with session retention and with it
            disabled (SGLANG_L3_DISABLE=sessions: plain LRU)

Prints per run the median TTFT of turns >= 2 and the tokens restored from L3;
last line: hint_ttft_vs_cold=R retained_hit_vs_lru=H (targets R <= 0.5, H >= 1.5).

    .venv/bin/python benchmark/agents.py [--agents 4] [--turns 3] [--context 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("SGLANG_L3_PUBLISH_STATS", "0")  # a benchmark server is not a server to report in doctor --stats

from sglang_l3.testing.server import (
    Server,
    ServerConfig,
    prompt,
    warm_hicache_hash_extension,
)

PAGE = 64
NEW = 12
MESSAGE = 48


@dataclass
class Run:
    label: str
    ttft: list[float] = field(default_factory=list)  # turns >= 2
    restored: int = 0  # tokens restored from L3 on turns >= 2
    device: int = 0  # tokens found on the device on turns >= 2
    turns: int = 0

    @property
    def median_ttft(self) -> float:
        return statistics.median(self.ttft) if self.ttft else float("nan")


def _config(args: argparse.Namespace, store: Path, **extra) -> ServerConfig:
    return ServerConfig(
        storage_dir=str(store),
        device=args.device,
        max_total_tokens=args.pool,
        chunked_prefill_size=256,
        prefetch_threshold=PAGE,
        page_size=PAGE,
        storage_extra_config=extra,
        env={"SGLANG_L3_DISABLE": args.disable} if args.disable else {},
    )


def _wait_hint(s: Server, hint_id: str, timeout: float) -> None:
    import json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if json.loads(s._request("GET", f"/sglang_l3/prefetch/{hint_id}"))["state"] != "staging":
            return
        time.sleep(0.05)


def agents_run(
    args: argparse.Namespace,
    label: str,
    store: Path,
    *,
    hints: bool,
    noise: bool,
    log_dir: Path,
    **extra,
) -> Run:
    run = Run(label)
    histories = {a: prompt(1000 + a, args.context) for a in range(args.agents)}
    order = [(t, a) for t in range(args.turns) for a in range(args.agents)]
    with Server(_config(args, store, **extra), log_dir / f"{label}.log", startup_timeout=900) as s:
        for i, (t, a) in enumerate(order):
            ids = histories[a] + prompt(10_000 * a + t, MESSAGE)
            g = s.generate(ids, NEW, extra={"session_id": f"agent-{a}"})
            histories[a] = ids + g.output_ids
            if t >= 1:
                run.ttft.append(g.ttft_s)
                run.restored += g.cached_storage
                run.device += g.cached_device
            run.turns += 1
            if noise:
                s.generate(prompt(50_000 + i, args.context), NEW)  # a one-off prompt, no session
            if i + 1 < len(order):
                nxt = order[i + 1][1]
                if hints and order[i + 1][0] >= 1:  # the next speaker has a context to stage
                    _, h = s.post("/sglang_l3/prefetch", {"session_id": f"agent-{nxt}"})
                    if args.think <= 0:
                        _wait_hint(s, h["hint_id"], 600)
                time.sleep(max(args.think, 0.0))
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--context", type=int, default=400, help="first-turn context tokens per agent")
    ap.add_argument("--pool", type=int, default=640, help="device pool tokens (about one context)")
    ap.add_argument(
        "--think",
        type=float,
        default=3.0,
        help="seconds between an answer and the next request",
    )
    ap.add_argument(
        "--cap-contexts",
        type=float,
        default=None,
        help="byte cap of the capped runs, in agent contexts (default: agents)",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--skip", default="", help="comma list of runs to skip: cold,hinted,capped")
    args = ap.parse_args()
    if args.agents < 4:
        ap.error("--agents must be >= 4")
    args.disable = ""
    skip = set(filter(None, args.skip.split(",")))
    warm_hicache_hash_extension()
    work = Path(tempfile.mkdtemp(prefix="sglang-l3-agents-"))
    print(
        f"workload: {args.agents} agents x {args.turns} turns, context {args.context}+{MESSAGE}/turn, "
        f"device pool {args.pool} tokens, think {args.think}s, logs {work}",
        flush=True,
    )
    runs: dict[str, Run] = {}
    if "cold" not in skip:
        runs["cold"] = agents_run(args, "cold", work / "cold", hints=False, noise=False, log_dir=work)
    if "hinted" not in skip:
        runs["hinted"] = agents_run(args, "hinted", work / "hinted", hints=True, noise=False, log_dir=work)
    if "capped" not in skip:
        # one agent's context in bytes: the cold run's store / agents (or a probe)
        probe, n = work / "cold", args.agents
        if not (probe / "pages").is_dir():
            probe, n = work / "probe", 1
            with Server(_config(args, probe), work / "probe.log", startup_timeout=900) as s:
                s.generate(prompt(1000, args.context), NEW)
        per_context = sum(f.stat().st_size for f in (probe / "pages").iterdir()) / n
        cap = int(per_context * (args.cap_contexts or args.agents))
        runs["retained"] = agents_run(
            args,
            "retained",
            work / "retained",
            hints=False,
            noise=True,
            log_dir=work,
            max_bytes=cap,
            min_free_bytes=0,
        )
        args.disable = "sessions"
        runs["lru"] = agents_run(
            args,
            "lru",
            work / "lru",
            hints=False,
            noise=True,
            log_dir=work,
            max_bytes=cap,
            min_free_bytes=0,
        )
        args.disable = ""
        print(f"capped runs: byte cap {cap / 2**20:.2f} MiB ({args.cap_contexts or args.agents} contexts)")
    print(f"{'run':10} {'turns>=2':>9} {'median TTFT ms':>15} {'L3 tokens':>10} {'device tokens':>14}")
    for r in runs.values():
        print(f"{r.label:10} {len(r.ttft):9d} {r.median_ttft * 1e3:15.1f} {r.restored:10d} {r.device:14d}")
    ratio = runs["hinted"].median_ttft / runs["cold"].median_ttft if {"hinted", "cold"} <= runs.keys() else float("nan")
    hit = (
        (runs["retained"].restored / runs["lru"].restored if runs["lru"].restored else float("inf"))
        if {"retained", "lru"} <= runs.keys()
        else float("nan")
    )
    print(f"hint_ttft_vs_cold={ratio:.2f} retained_hit_vs_lru={hit:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
