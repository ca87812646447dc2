"""`python -m sglang_l3.testing.demo_server`: agents talking to a real SGLang server on
CPU, with the conversation prefixes coming back from the L3 store on disk.

Starts `python -m sglang.launch_server --device cpu` on a packaged tiny hybrid
model (`--model`: tiny-qwen3next, the default; tiny-qwen35, the user's
Qwen3_5ForConditionalGeneration architecture; tiny-qwen35-text; dummy weights,
input ids, nothing downloaded) with `--hicache-storage-backend file
--hicache-mem-layout buffer_only` and a device KV pool too small for all agents
at once. `make demo MODEL=tiny-qwen35` picks the model. The agents
take turns; each turn sends the agent's whole history plus a new message. Per
turn it prints where the reused prefix came from, as the server reports it
(`cached_tokens_details`: device / L3), and the time to first token — next to
the time to first token of same-length prompts that nothing is cached for
(computed from scratch on the same server after a warm-up request; the median
of --control-repeats of them).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sglang_l3.testing.server import (
    DEFAULT_MODEL,
    PACKAGED_MODELS,
    Server,
    ServerConfig,
    ServerError,
    model_dir,
    prompt,
    warm_hicache_hash_extension,
)

MODEL_NAMES = {
    "tiny-qwen3next": "tiny Qwen3-Next",
    "tiny-qwen35": "tiny Qwen3.5, multimodal",
    "tiny-qwen35-text": "tiny Qwen3.5, text-only",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_l3.testing.demo_server", description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="./l3-store", help="L3 directory (default ./l3-store)")
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a packaged model ({', '.join(PACKAGED_MODELS)}; default {DEFAULT_MODEL}) or a model directory",
    )
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=600, help="per-agent system prompt length")
    ap.add_argument("--user-tokens", type=int, default=64, help="new tokens per user message")
    ap.add_argument("--reply-tokens", type=int, default=16, help="greedy reply length")
    ap.add_argument(
        "--device-pool", type=int, default=1024, help="device KV pool in tokens (small: agents evict each other)"
    )
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunked-prefill-size", type=int, default=256)
    ap.add_argument("--prefetch-threshold", type=int, default=64)
    ap.add_argument(
        "--probe-tokens",
        type=int,
        default=0,
        help="after the agents: TTFT of an N-token prompt computed vs restored from L3",
    )
    ap.add_argument("--probe-repeats", type=int, default=3)
    ap.add_argument(
        "--control-repeats",
        type=int,
        default=3,
        help="unseen same-length prompts per turn for the 'nothing cached' column (median)",
    )
    ap.add_argument("--log", default=None, help="server log file (default: a temp file, removed unless the demo fails)")
    args = ap.parse_args(argv)

    try:
        model_dir(args.model)
    except ServerError as e:
        ap.error(str(e))
    store = Path(args.store).resolve()
    tmp = None if args.log else Path(tempfile.mkdtemp(prefix="sglang-l3-demo-"))
    log = Path(args.log) if args.log else tmp / "server.log"
    ok = False
    try:
        code = _run(args, store, log)
        ok = code == 0
        return code
    except ServerError as e:
        print(f"sglang-l3 demo: {e}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            if ok:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                print(f"  server log kept: {log}")


def _run(args: argparse.Namespace, store: Path, log: Path) -> int:
    cfg = ServerConfig(
        model=args.model,
        storage_dir=str(store),
        max_total_tokens=args.device_pool,
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
        prefetch_threshold=args.prefetch_threshold,
    )
    warm_hicache_hash_extension()
    server = Server(cfg, log)
    name = MODEL_NAMES.get(args.model, args.model)
    print(f"sglang-l3 demo: starting a CPU server ({name}, L3 = file store {store})")
    print("  " + server.shell_command())
    print(f"  log: {log}")
    t0 = time.perf_counter()
    print("  starting (1-3 minutes on a busy machine) ...", flush=True)
    server.start(progress=lambda s: print(f"  ... still starting ({s:.0f} s)", flush=True))
    try:
        print(f"  ready in {time.perf_counter() - t0:.0f} s", flush=True)
        # the first request pays one-off costs (allocator, thread start-up): not a measurement
        server.generate(prompt(1, args.system_tokens), 1)
        print()
        if args.turns > 0:
            _converse(server, args)
        if args.probe_tokens > 0:
            _probe(server, args.probe_tokens, args.probe_repeats)
        return 0
    finally:
        server.stop()


def _converse(server: Server, args: argparse.Namespace) -> None:
    history = {a: prompt(7000 + a, args.system_tokens) for a in range(1, args.agents + 1)}
    rows = []
    header = (
        f"{'agent':>5} {'turn':>4} {'prompt':>6}  {'prefix came from':<24} {'TTFT':>8}  {'TTFT, nothing cached':>20}"
    )
    print(header)
    print("-" * len(header))
    control_seed = 90_000
    for turn in range(1, args.turns + 1):
        for agent, past in history.items():
            ids = past + prompt(100 * agent + turn, args.user_tokens)
            g = server.generate(ids, args.reply_tokens)
            history[agent] = ids + g.output_ids
            # the same amount of work with nothing to reuse: unseen prompts of equal
            # length, the median of a few (one run swings with the machine's load)
            controls = []
            for _ in range(max(1, args.control_repeats)):
                control_seed += 1
                controls.append(server.generate(prompt(control_seed, len(ids)), 1))
            c = sorted(controls, key=lambda x: x.ttft_s)[len(controls) // 2]
            rows.append((g, c))
            print(
                f"{agent:>5} {turn:>4} {len(ids):>6}  {g.source:<24} {g.ttft_s * 1e3:>6.0f} ms"
                f"  {c.ttft_s * 1e3:>17.0f} ms",
                flush=True,
            )
    l3 = [(g, c) for g, c in rows if g.cached_storage > 0]
    device = [(g, c) for g, c in rows if g.cached_device > 0 and g.cached_storage == 0]
    print()
    print(
        f"turns: {len(rows)}; prefix from L3: {len(l3)}; from the device only: {len(device)}; "
        f"nothing reused: {len(rows) - len(l3) - len(device)}"
    )
    if l3:
        hit = statistics.median(g.ttft_s for g, _ in l3)
        cold = statistics.median(c.ttft_s for _, c in l3)
        restored = statistics.median(g.cached_storage for g, _ in l3)
        print(
            f"median TTFT with an L3 hit: {hit * 1e3:.0f} ms; same-length prompt computed: "
            f"{cold * 1e3:.0f} ms ({cold / hit:.1f}x); median tokens restored: {restored:.0f}"
        )


def _probe(server: Server, n: int, repeats: int) -> None:
    """TTFT of an n-token prompt: computed (never seen) vs after /flush_cache
    (device tree empty, prefix restored from L3). Medians over `repeats`."""
    cold, warm, restored = [], [], []
    for i in range(repeats):
        ids = prompt(50_000 + i, n)
        server.flush_cache()
        c = server.generate(ids, 1)
        server.flush_cache()
        w = server.generate(ids, 1)
        if c.cached_tokens or not w.cached_storage or w.output_ids != c.output_ids:
            raise SystemExit(f"probe {i}: unexpected cache use {c.source} / {w.source}")
        cold.append(c.ttft_s)
        warm.append(w.ttft_s)
        restored.append(w.cached_storage)
    print(f"\nTTFT probe, {n}-token prompt, {repeats} runs (median [min..max]):")
    print(f"  computed:          {_ms(cold)}")
    print(f"  restored from L3:  {_ms(warm)}   ({restored[0]} tokens restored)")


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:6.0f} ms [{min(xs) * 1e3:.0f}..{max(xs) * 1e3:.0f}]"


if __name__ == "__main__":
    sys.exit(main())
