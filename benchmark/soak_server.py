"""Soak through real servers at TP=2 (the user's topology): agents with shared
prefixes, random /flush_cache, aborts and injected single-rank storage faults,
every answer compared with a TP=2 server that has no cache. Not a timed test:
it prints counts, and its last line is exactly

    requests=N mismatches=M hangs=H restored_tokens=T rank_disagreements=D restored_vs_restorable=R/C

    nice -n 10 .venv/bin/python benchmark/soak_server.py --tp 2
        [--requests 300 --agents 8 --seed 1 --new-tokens 4 --work DIR]
        [--pool 4096 --hicache-ratio 0.09 --max-history 2300]   (issue 24's workload)

Phase 1 runs the whole workload on the no-cache server (histories grow with
its answers); phase 2 replays the same inputs, in the same order, on a
HiCache + L3 server (SGLANG_L3_VERIFY=1: every restore decision is compared
across the ranks, and a difference stops the server: counted in
rank_disagreements). Between requests phase 2 flushes the device cache, damages
one page file of one rank (delete / truncate / flip / foreign), or sends an
extra copy of the next request and aborts it. A request that does not answer
within --request-timeout is a hang (the soak stops there).

restored_vs_restorable=R/C: over the requests sent right after a /flush_cache (the
device holds nothing then), R = tokens restored from L3 and C = tokens restorable by
checkpoint: the agent's previous turn as computed (its input and its answer but the
last token), floored to the 64-token Mamba checkpoint grid (a hybrid prefix is only
restorable where a state is stored). R < C means L3 lost part of a turn it was given
(issue 24: writes dropped as parent_not_stored).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
from pathlib import Path

VERIFY_FAIL = "TP ranks made different L3 restore decisions"
CHECKPOINT = 64  # tokens: the Mamba state grid of the served model at page 64


def workload(rng: random.Random, n: int, agents: int) -> list[tuple[int, list[int]]]:
    """(agent, new user tokens) per request; agents share one of two system prompts."""
    return [
        (
            rng.randrange(agents),
            [rng.randrange(3, 1003) for _ in range(rng.randrange(24, 72))],
        )
        for _ in range(n)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument(
        "--max-history",
        type=int,
        default=640,
        help="tokens; a longer history starts over",
    )
    ap.add_argument("--pool", type=int, default=1536, help="device KV tokens (small: evictions)")
    ap.add_argument(
        "--hicache-ratio",
        type=float,
        default=None,
        help="host staging buffer / device pool (default: the server's; 0.09 with --pool 4096 = 384 tokens)",
    )
    ap.add_argument("--p-flush", type=float, default=0.06)
    ap.add_argument("--p-fault", type=float, default=0.08)
    ap.add_argument("--p-abort", type=float, default=0.05)
    ap.add_argument("--request-timeout", type=float, default=180.0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--work", default=None, help="logs and store (default: a temporary directory)")
    args = ap.parse_args()

    from sglang_l3.testing.server import (
        Server,
        ServerConfig,
        ServerError,
        prompt,
        warm_hicache_hash_extension,
    )

    warm_hicache_hash_extension()
    from sglang.srt.mem_cache.utils import get_hash_str

    work = Path(args.work or tempfile.mkdtemp(prefix="sglang-l3-soak-server-"))
    work.mkdir(parents=True, exist_ok=True)
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    rng = random.Random(args.seed)
    plan = workload(rng, args.requests, args.agents)
    systems = [prompt(9000 + i, 128) for i in range(2)]

    def config(with_store: bool) -> ServerConfig:
        return ServerConfig(
            storage_dir=str(store) if with_store else None,
            tp_size=args.tp,
            max_total_tokens=args.pool,
            chunked_prefill_size=256,
            page_size=64,
            prefetch_threshold=64 if with_store else None,
            extra_args=["--hicache-ratio", str(args.hicache_ratio)] if with_store and args.hicache_ratio else [],
            env={"SGLANG_L3_VERIFY": "1"},
        )

    # ---------------------------------------------------------------- phase 1
    inputs: list[list[int]] = []
    refs = []
    restorable: list[int] = []  # per request: the previous turn as computed, on the checkpoint grid
    history = {a: list(systems[a % 2]) for a in range(args.agents)}
    computed = {a: 0 for a in range(args.agents)}
    t0 = time.monotonic()
    with Server(config(False), work / "plain.log", startup_timeout=args.startup_timeout) as plain:
        print(
            f"no-cache TP={args.tp} server up ({time.monotonic() - t0:.0f}s); reference run",
            flush=True,
        )
        for i, (agent, user) in enumerate(plan):
            ids = history[agent] + user
            g = plain.generate(ids, args.new_tokens, timeout=args.request_timeout)
            inputs.append(ids)
            refs.append(g)
            restorable.append(min(computed[agent], len(ids) - 1) // CHECKPOINT * CHECKPOINT)
            history[agent] = ids + g.output_ids
            computed[agent] = len(ids) + len(g.output_ids) - 1  # the last token was sampled, never computed
            if len(history[agent]) > args.max_history:
                history[agent] = list(systems[agent % 2])
                computed[agent] = 0
            if (i + 1) % 50 == 0:
                print(f"  reference {i + 1}/{len(plan)}", flush=True)

    # ---------------------------------------------------------------- phase 2
    requests = mismatches = hangs = restored = disagreements = 0
    flush_restored = flush_restorable = 0
    flushes = faults = aborts = 0
    max_dlogp = 0.0
    t1 = time.monotonic()
    server = Server(config(True), work / "hicache.log", startup_timeout=args.startup_timeout)
    try:
        server.start()
        print(
            f"HiCache+L3 TP={args.tp} server up ({time.monotonic() - t1:.0f}s); soak",
            flush=True,
        )
        for i, ids in enumerate(inputs):
            r = rng.random()
            flushed = r < args.p_flush
            if flushed:
                server.flush_cache(timeout=args.request_timeout)
                flushes += 1
            elif r < args.p_flush + args.p_fault:
                if fault(store, ids, rng, args.tp, get_hash_str):
                    faults += 1
            elif r < args.p_flush + args.p_fault + args.p_abort:
                aborts += abort_copy(
                    server,
                    ids,
                    args.new_tokens,
                    rng,
                    f"soak-abort-{i}",
                    args.request_timeout,
                )
            try:
                g = server.generate(ids, args.new_tokens, timeout=args.request_timeout)
            except (
                TimeoutError,
                urllib.error.URLError,
                ConnectionError,
                ServerError,
            ) as e:
                if VERIFY_FAIL in server.log_text():
                    disagreements += 1
                else:
                    hangs += 1
                print(f"  request {i}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                break
            requests += 1
            restored += g.cached_storage
            if flushed:
                flush_restored += g.cached_storage
                flush_restorable += restorable[i]
                if g.cached_storage < restorable[i]:
                    print(f"  short restore request {i}: {g.cached_storage} of {restorable[i]}", flush=True)
            want = refs[i]
            dlogp = max((abs(x - y) for x, y in zip(g.logprobs, want.logprobs)), default=0.0)
            max_dlogp = max(max_dlogp, dlogp)
            if g.output_ids != want.output_ids or dlogp > 0.0:
                mismatches += 1
                print(
                    f"  MISMATCH request {i}: {g.output_ids} vs {want.output_ids} (dlogprob {dlogp:.3g}, {g.source})",
                    flush=True,
                )
            if (i + 1) % 50 == 0:
                print(
                    f"  soak {i + 1}/{len(inputs)}: restored_tokens={restored}",
                    flush=True,
                )
        disagreements = max(disagreements, server.log_text().count(VERIFY_FAIL))
    finally:
        server.stop()
    print(
        f"soak_server: tp={args.tp} agents={args.agents} seed={args.seed} flushes={flushes} "
        f"faults={faults} aborts={aborts} max_logprob_diff={max_dlogp:.3g} "
        f"reference {t1 - t0:.0f}s, soak {time.monotonic() - t1:.0f}s, logs in {work}"
    )
    print(
        f"requests={requests} mismatches={mismatches} hangs={hangs} "
        f"restored_tokens={restored} rank_disagreements={disagreements} "
        f"restored_vs_restorable={flush_restored}/{flush_restorable}",
        flush=True,
    )
    return 1 if (mismatches or hangs or disagreements or requests < len(inputs)) else 0


def fault(store: Path, ids: list[int], rng: random.Random, tp: int, get_hash_str) -> bool:
    """Damage one rank's page file of the next request's prefix (or any page)."""
    pages = store / "pages"
    if not pages.is_dir():
        return False
    keys = get_hash_str(ids[: len(ids) // 64 * 64], None, page_size=64)
    rank = rng.randrange(tp)
    mine = [p for p in pages.glob(f"*.r{rank}of{tp}.bin")]
    wanted = [p for p in mine if p.name.split(".", 1)[0] in set(keys)] or mine
    if not wanted:
        return False
    victim = rng.choice(sorted(wanted))
    mode = rng.choice(["delete", "truncate", "flip", "foreign"] if tp == 2 else ["delete", "truncate", "flip"])
    try:
        size = victim.stat().st_size
        if mode == "delete":
            victim.unlink()
        elif mode == "truncate":
            os.truncate(victim, size // 2)
        elif mode == "flip":
            with open(victim, "r+b") as f:
                f.seek(size - 100)
                b = f.read(1)
                f.seek(size - 100)
                f.write(bytes([b[0] ^ 0xFF]))
        else:  # the other rank's page of the same key: valid, but another shard
            other = victim.with_name(victim.name.replace(f".r{rank}of{tp}.", f".r{1 - rank}of{tp}."))
            tmp = victim.with_suffix(".foreign")
            shutil.copyfile(other, tmp)
            os.replace(tmp, victim)
    except OSError:  # raced with the store's own eviction / quarantine
        return False
    return True


def abort_copy(
    server,
    ids: list[int],
    new_tokens: int,
    rng: random.Random,
    rid: str,
    timeout: float,
) -> int:
    """Send a copy of the next request and abort it after a random short delay."""
    box: dict = {}

    def run() -> None:
        try:
            box["g"] = server.generate(ids, new_tokens * 8, timeout=timeout, rid=rid)
        except Exception as e:  # noqa: BLE001 - an aborted stream may end in any way
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(rng.uniform(0.0, 1.5))
    try:
        server.abort(rid)
    except (OSError, urllib.error.URLError):
        pass
    t.join(timeout)
    return 1


if __name__ == "__main__":
    sys.exit(main())
