"""Two real Hermes agents at once against the CPU server with L3 and a device pool of
about one agent's context, for longer than the test (issue 30, item 6).

The scenario of test/agents/test_hermes_l3_restart.py without the restart
(sglang_l3.testing.hermes_scenario): real `hermes -z … -t file` processes
(hermes-agent 0.19.0 in `.venv-hermes`, `make install`) in sandboxes, tiny Qwen3.5
(text) with the README's agent flags on CPU, buffer-only HiCache over the `file`
store (host buffer --host-ratio x the pool), patch scripted-decode making each
agent's model read and write files in its sandbox for --calls model calls, then
answer. The agents reach the server through
a relay (sglang_l3.testing.relay) that times each call's first streamed chunk.

Prints per call: agent, step, prompt tokens, cached tokens (total, device, L3), the
ideal (page-aligned common prefix with the agent's previous prompt + the server's
answer) and TTFT (relay to the server's first streamed chunk); with --check, the
same prompts are replayed on a no-cache server and every call's tokens and
log-probabilities compared; then the L3 write counters (what was dropped, by reason). Last line:

    reuse_vs_ideal=R l3_tokens=N calls=C

R = cached / ideal summed over every call after an agent's first, N = tokens that
came from L3 over all calls, C = model calls of both agents.

    nice -n 10 .venv/bin/python benchmark/hermes_agents.py [--calls 12] [--pool 12800] [--host-ratio 2] [--check] [--no-l3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

os.environ.setdefault("SGLANG_L3_PUBLISH_STATS", "0")  # a benchmark server is not a server to report in doctor --stats

from sglang_l3.testing import hermes
from sglang_l3.testing.hermes_scenario import (
    CONTEXT,
    SERVED_NAME,
    SMALL_HOST_RATIO,
    SMALL_POOL_MAX_TOKENS,
    host_ratio_args,
    l3_metric_lines,
    last_log_entry,
    notes_text,
    replay_no_cache,
    reuse_rows,
    server,
    server_config,
    steps,
    task_marker,
    task_prompt,
)
from sglang_l3.testing.relay import Relay
from sglang_l3.testing.script_writer import read_records, write_script
from sglang_l3.testing.server import warm_hicache_hash_extension

NAMES = ("agent-amber", "agent-birch")


class Timings:
    """Per agent, the relay's time to the first streamed chunk of each chat call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft: dict[str, list[float]] = {n: [] for n in NAMES}

    def __call__(self, path: str, body: bytes, seconds: float) -> None:
        if not path.endswith("/chat/completions"):
            return
        req = json.loads(body or b"{}")
        if not req.get("tools"):
            return
        text = json.dumps(req.get("messages", []))
        who = [n for n in NAMES if task_marker(n) in text]
        if len(who) == 1:
            with self.lock:
                self.ttft[who[0]].append(seconds)


def run(args: argparse.Namespace, root: Path) -> int:
    warm_hicache_hash_extension()
    record = root / "record.jsonl"
    rules = {task_marker(n): steps(root / n / "work", n, args.calls) for n in NAMES}
    script = write_script(root / "script.json", record, rules, record_prompt_ids=True)
    if args.no_l3:  # the control: upstream's device cache alone, same pool
        config = server_config(script, pool=args.pool, extra=["--enable-metrics"])
    else:
        config = server_config(
            script,
            storage_dir=root / "store",
            pool=args.pool,
            extra=["--enable-metrics", *host_ratio_args(args.host_ratio)],
        )
    timings = Timings()
    s = server(root, "l3", config)
    print(f"server: {s.shell_command()}", flush=True)
    s.start()
    relay = Relay(lambda: s.base, observe=timings).start()
    done: dict[str, Any] = {}
    try:
        boxes = {
            n: hermes.Sandbox.create(
                root / n,
                base_url=relay.base + "/v1",
                model=SERVED_NAME,
                context_length=CONTEXT,
                max_tokens=args.max_tokens,
            )
            for n in NAMES
        }
        for n, box in boxes.items():
            (box.work / "notes.txt").write_text(notes_text(n))

        def go(n: str) -> None:
            done[n] = boxes[n].run(task_prompt(n), timeout=args.timeout)

        threads = [threading.Thread(target=go, args=(n,)) for n in NAMES]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # what did not reach L3, and why (l3_write_dropped{reason}); parents found in flight
        writes = [x for x in l3_metric_lines(s) if "l3_write_" in x or "branch_backups" in x]
    finally:
        relay.stop()
        s.stop()
    print("L3 writes: " + ("; ".join(writes) if writes else "nothing dropped"))

    ok = True
    rows = read_records(record)
    for n in NAMES:
        proc = done.get(n)
        if proc is None or proc.returncode != 0 or f"{n} copied the notes." not in proc.stdout:
            ok = False
            print(f"{n}: did not finish: {proc.stderr[-2000:] if proc else 'no process'}")
        elif (boxes[n].work / "log.txt").read_text() != last_log_entry(n, args.calls):
            ok = False
            print(f"{n}: log.txt is not what the script wrote last")
    print(f"{'agent':12} {'step':>4} {'prompt':>6} {'cached':>6} {'device':>6} {'L3':>6} {'ideal':>6} {'ttft_s':>7}")
    cached = ideal = l3 = 0
    calls = 0
    for n in NAMES:
        mine = [r for r in rows if r["rule"] == task_marker(n)]
        calls += len(mine)
        ttft = timings.ttft[n]
        later = {r["step"]: r for r in reuse_rows(rows, task_marker(n))}
        for k, r in enumerate(mine):
            c = r["cached"]
            row = later.get(r["step"]) if k else None
            t = f"{ttft[k]:7.2f}" if k < len(ttft) else "      ?"
            print(
                f"{n:12} {r['step']:>4} {r['prompt_tokens']:>6} {c.get('total', 0):>6} {c.get('device', 0):>6} "
                f"{c.get('storage', 0):>6} {row['ideal'] if row else '-':>6} {t}"
            )
            l3 += c.get("storage", 0)
            if row is not None:
                cached += row["cached"]
                ideal += row["ideal"]
    if args.check:
        bad = replay_no_cache(rows, rules, root)
        print("no-cache check: " + ("every call equal" if not bad else "DIFFERS: " + ", ".join(bad)))
        ok = ok and not bad
    print("figures from this machine; a loaded box's TTFTs are not valid figures")
    print(f"reuse_vs_ideal={cached / ideal if ideal else float('nan'):.3f} l3_tokens={l3} calls={calls}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=12, help="model calls per agent (>= 3; the last one answers)")
    ap.add_argument(
        "--pool", type=int, default=12800, help="device KV pool, tokens (--max-total-tokens): about one agent's context"
    )
    ap.add_argument(
        "--host-ratio",
        type=float,
        default=2.0,
        help=f"host buffer / device pool (--hicache-ratio; {SMALL_HOST_RATIO}: less than one context)",
    )
    ap.add_argument("--max-tokens", type=int, default=SMALL_POOL_MAX_TOKENS, help="Hermes's model.max_tokens")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per agent process")
    ap.add_argument(
        "--no-l3", action="store_true", help="the control: no HiCache and no store (upstream's device cache alone)"
    )
    ap.add_argument("--check", action="store_true", help="replay every call on a no-cache server and compare")
    ap.add_argument("--keep", type=Path, help="work directory to keep (default: a temporary one)")
    args = ap.parse_args()
    if args.calls < 3:
        ap.error("--calls must be >= 3")
    why = hermes.missing_reason()
    if why:
        print(why, file=sys.stderr)
        return 2
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        return run(args, args.keep)
    with tempfile.TemporaryDirectory(prefix="hermes-agents-") as d:
        return run(args, Path(d))


if __name__ == "__main__":
    sys.exit(main())
