"""Soak through real servers at TP=2 (the user's topology): agents with shared
prefixes, random /flush_cache, aborts, injected single-rank storage faults and
shared-prefix bursts, every answer compared with a TP=2 server that has no cache. Not a timed test:
it prints counts, and its last line is exactly

    requests=N mismatches=M hangs=H restored_tokens=T rank_disagreements=D restored_vs_restorable=R/C crashes=X leaks=L

    nice -n 10 .venv/bin/python benchmark/soak_server.py --tp 2
        [--requests 300 --agents 8 --seed 1 --new-tokens 4 --work DIR]
        [--pool 4096 --hicache-ratio 0.09 --max-history 2300]   (issue 24's workload)
        [--entries N]                  (the same plan and draws, cut after N entries: replay one request)
        [--disable-overlap-schedule]   (both servers; the user's have it on)
        [--model tiny-qwen35-text]     (the user's architecture; default tiny Qwen3-Next)
        [--backend mooncake]           (L3 on a loopback Mooncake store instead of the file store)
        [--mooncake-segment 16MB]      (a small store: Mooncake evicts objects, each rank's apart)
        [--explicit-sessions 4 --p-hint 0.5 --p-close 0.1 --predicted-return p50 --tool-pin on]
                                       (the agent features, below)

Phase 1 runs the whole workload on the no-cache server (histories grow with
its answers); phase 2 replays the same inputs, in the same order, on a
HiCache + L3 server (SGLANG_L3_VERIFY=1: every restore decision is compared
across the ranks, and a difference stops the server: counted in
rank_disagreements). Between requests phase 2 flushes the device cache, damages
one page file of one rank (delete / truncate / flip / foreign), or sends an
extra copy of the next request and aborts it, or (--p-abort-restore, issue 48)
flushes the device and aborts such a copy at a random point after its restore from
L3 began (0-0.5 s after the server logs its streamed restore's start). A request that
does not answer within --request-timeout is a hang (the soak stops there); crashes=1
when the L3 server is not alive at the end, leaks= counts upstream's strict idle leak
check firing (`pool memory leak detected`: the scheduler exits).

restored_vs_restorable=R/C: over the requests sent right after a /flush_cache (the
device holds nothing then), R = tokens restored from L3 and C = tokens restorable by
checkpoint: the deepest Mamba state the agent's previous turn kept (a hybrid prefix is
only restorable where a state is stored, and upstream inserts a finished turn only up
to it): its prompt's last 64-token boundary (prefill), or the last multiple of 256
(`mamba_track_interval`) its decode passed, whichever is deeper (`kept_checkpoint`;
test/e2e/test_flush_restore_server.py; before issue 33 C counted the whole computed
turn floored to 64, so a turn ending by decode past its prompt's boundary, e.g. 445
prompt + 4 new = 448 computed, counted 64 tokens no state ever covered). R < C means L3 lost part of a turn it was given
(issue 24: writes dropped as parent_not_stored), or a page of it was damaged by this
soak: each short restore is printed with which, and the summary line counts them
(short_restores=, short_after_damage=).

Sessions and hints (phase 2 only: neither may change an answer). Agents below
--explicit-sessions send a top-level `session_id` (the others none: implicit sessions);
with --p-hint a turn is preceded by a "speaks next" hint (`POST /sglang_l3/prefetch`: the
session, or the agent's last context as `input_ids`), for another agent's context instead
with --p-hint-other (a wrong guess), then the turn is sent at once or after the hint
settled; with --p-close an explicit agent's session is closed after its turn (its next
turn continues under the same id); aborted copies carry the agent's session id; and
--predicted-return / --tool-pin set SGLANG_L3_PREDICTED_RETURN / SGLANG_L3_TOOL_PIN on the
L3 server. A hint that the server answers with anything but 200, or that ends "failed",
and a close answered with anything but 200, are counted (hint_errors=) and fail the run;
--hints-drawn-not-sent keeps the hints' draws without sending them (an A/B control).

Mooncake (--backend mooncake): phase 2's server keeps L3 in a loopback Mooncake store
(master + storage node, sglang_l3.testing.mooncake, started for the run and stopped
after it; pages live on the storage node, `global_segment_size=0`), the distributed
L3's lifecycle under the same workload. Page damage is the file store's (its files):
--p-fault defaults to 0 there and must stay 0; a burst's writer prefix is not polled
for in the store (the /flush_cache after it waits for the write-through); everything
else, and every check, is as with the file store.

Bursts (issue 24; --p-burst of the plan's entries): a long prefix (4-8x the host
staging buffer, on a device pool too short for two copies of it) is written to L3
by one request, flushed from the device, then 2-4 requests sharing it are sent at
once: the first one at once, the others as soon as the server logs that its
streamed restore has started (or after 5 s), so they meet it in flight. Each
burst request is one of the counted requests.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
from pathlib import Path

VERIFY_FAIL = "TP ranks made different L3 restore decisions"
CHECKPOINT = 64  # tokens: the Mamba state grid of the served model at page 64
TRACK_INTERVAL = 256  # upstream's --mamba-track-interval default: where decode keeps a state
STREAM_START = re.compile(r"streamed restore req=\S+ start=")
LEAK = "memory leak detected"  # upstream's strict idle check (on by default): the scheduler exits


def kept_checkpoint(prompt_len: int, computed: int) -> int:
    """The deepest Mamba state a turn of `prompt_len` prompt tokens and `computed` tokens
    computed keeps (its prefix on the 64-token grid, as every restored or cached prefix
    is): prefill keeps the prompt's last CHECKPOINT boundary, decode the multiples of
    TRACK_INTERVAL it passes; the turn is inserted, and written to L3, only up to it."""
    decode = computed // TRACK_INTERVAL * TRACK_INTERVAL
    return max(prompt_len // CHECKPOINT * CHECKPOINT, decode if decode > prompt_len else 0)


def _tokens(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(3, 1003) for _ in range(rng.randrange(lo, hi))]


def workload(rng: random.Random, n: int, agents: int, p_burst: float, host: int) -> list[tuple]:
    """Entries until n requests: ("turn", agent, new user tokens), agents sharing one of
    two system prompts, or ("burst", prefix, writer tail, [2-4 tails]) of a fresh
    prefix of 4-8x the host buffer (whole pages, so a hit can cover all of it)."""
    plan: list[tuple] = []
    count = 0
    while count < n:
        if rng.random() < p_burst and n - count >= 2:
            length = rng.randrange(4 * host, 8 * host + 1) // 64 * 64
            k = min(rng.randrange(2, 5), n - count)
            prefix = [rng.randrange(3, 1003) for _ in range(length)]
            plan.append(("burst", prefix, _tokens(rng, 8, 24), [_tokens(rng, 24, 72) for _ in range(k)]))
            count += k
        else:
            plan.append(("turn", rng.randrange(agents), _tokens(rng, 24, 72)))
            count += 1
    return plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument(
        "--model",
        default=None,
        help="a packaged tiny model (tiny-qwen3next, the default; tiny-qwen35-text: the user's architecture)",
    )
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
    ap.add_argument(
        "--pool",
        type=int,
        default=2304,
        help="device KV tokens (small: evictions; shorter than two copies of a burst's prefix)",
    )
    ap.add_argument(
        "--hicache-ratio",
        type=float,
        default=None,
        help="host staging buffer / device pool (default: --host-tokens / --pool; 0.09 with --pool 4096 = 384 tokens)",
    )
    ap.add_argument("--host-tokens", type=int, default=256, help="host staging buffer without --hicache-ratio")
    ap.add_argument("--p-burst", type=float, default=0.15, help="share of plan entries that are bursts")
    ap.add_argument("--p-flush", type=float, default=0.06)
    ap.add_argument(
        "--p-fault", type=float, default=None, help="damage a page file of one rank (file store: 0.08; mooncake: 0)"
    )
    ap.add_argument("--p-abort", type=float, default=0.05)
    ap.add_argument(
        "--p-abort-restore",
        type=float,
        default=0.05,
        help="flush, then abort a copy of the next request at a random point of its restore from L3 (issue 48)",
    )
    ap.add_argument(
        "--explicit-sessions",
        type=int,
        default=0,
        help="agents 0..N-1 send a top-level session_id (the others none: implicit sessions)",
    )
    ap.add_argument("--p-hint", type=float, default=0.0, help="share of turns preceded by a speaks-next hint")
    ap.add_argument("--p-hint-other", type=float, default=0.25, help="share of hints naming another agent")
    ap.add_argument("--p-close", type=float, default=0.0, help="close an explicit agent's session after its turn")
    ap.add_argument("--predicted-return", default=None, help="SGLANG_L3_PREDICTED_RETURN on the L3 server")
    ap.add_argument("--tool-pin", default=None, help="SGLANG_L3_TOOL_PIN on the L3 server")
    ap.add_argument("--trace", action="store_true", help="print what phase 2 does before each turn")
    ap.add_argument(
        "--hints-drawn-not-sent",
        action="store_true",
        help="an A/B control: the same draws as --p-hint, no hint sent (every other action as with them)",
    )
    ap.add_argument("--request-timeout", type=float, default=180.0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--work", default=None, help="logs and store (default: a temporary directory)")
    ap.add_argument(
        "--entries",
        type=int,
        default=None,
        help="run only the plan's first N entries (the same plan and draws: to replay one burst quickly)",
    )
    ap.add_argument(
        "--backend",
        choices=("file", "mooncake"),
        default="file",
        help="phase 2's L3: the file store (default) or a loopback Mooncake store",
    )
    ap.add_argument(
        "--mooncake-segment",
        default="512MB",
        help="the Mooncake storage node's segment (at least 16MB; small: the store evicts objects, each rank's on its own)",
    )
    ap.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="both servers without overlap scheduling (the user's servers have it on)",
    )
    args = ap.parse_args()
    if args.p_fault is None:
        args.p_fault = 0.08 if args.backend == "file" else 0.0
    if args.backend == "mooncake" and args.p_fault:
        ap.error("--p-fault damages the file store's page files: 0 with --backend mooncake")
    mooncake = None
    if args.backend == "mooncake":
        from sglang_l3.testing import mooncake as mc

        reason = mc.unavailable_reason()
        if reason:
            ap.error(f"--backend mooncake: {reason}")

    from sglang_l3.testing.server import (
        Generation,
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
    ratio = args.hicache_ratio or args.host_tokens / args.pool
    host = int(ratio * args.pool) // 64 * 64  # the host buffer a burst's prefix is sized by
    if host < 64 or 8 * host + 80 > args.pool:
        ap.error("a burst context (4-8x the host buffer, at least one page) must fit the device pool")
    plan = workload(rng, args.requests, args.agents, args.p_burst, host)
    if args.entries is not None:
        plan = plan[: args.entries]
    systems = [prompt(9000 + i, 128) for i in range(2)]

    l3_env = {"SGLANG_L3_VERIFY": "1"}
    if args.predicted_return is not None:
        l3_env["SGLANG_L3_PREDICTED_RETURN"] = args.predicted_return
    if args.tool_pin is not None:
        l3_env["SGLANG_L3_TOOL_PIN"] = args.tool_pin

    def config(with_store: bool) -> ServerConfig:
        l3: dict = {"storage_dir": str(store) if with_store else None}
        if with_store and mooncake is not None:
            l3 = {"storage_backend": "mooncake", "storage_extra_config": mooncake.extra_config()}
        return ServerConfig(
            **({"model": args.model} if args.model else {}),
            **l3,
            tp_size=args.tp,
            max_total_tokens=args.pool,
            chunked_prefill_size=256,
            page_size=64,
            prefetch_threshold=64 if with_store else None,
            extra_args=["--hicache-ratio", f"{ratio:.6f}"] if with_store else [],
            env=l3_env if with_store else {"SGLANG_L3_VERIFY": "1"},
            overlap_schedule=not args.disable_overlap_schedule,
        )

    # ---------------------------------------------------------------- phase 1
    inputs: list = []  # per plan entry: a request's ids, or a burst's (writer, [ids])
    refs: list = []  # per plan entry: a Generation, or a burst's list of them
    restorable: list[int] = []  # per plan entry: the deepest state the agent's previous turn kept
    speakers: list[int | None] = []  # per plan entry: the agent of a turn (None: a burst)
    history = {a: list(systems[a % 2]) for a in range(args.agents)}
    kept = {a: 0 for a in range(args.agents)}
    if args.backend == "mooncake":  # before phase 1: a store that cannot start fails at once
        mooncake = mc.MooncakeCluster(work / "mooncake", segment_size=args.mooncake_segment).start()
        atexit.register(mooncake.stop)  # also when phase 1 fails (stop is idempotent)
    t0 = time.monotonic()
    with Server(config(False), work / "plain.log", startup_timeout=args.startup_timeout) as plain:
        print(
            f"no-cache TP={args.tp} server up ({time.monotonic() - t0:.0f}s); reference run",
            flush=True,
        )
        done = 0
        for entry in plan:
            before = done
            if entry[0] == "burst":
                _, prefix, wtail, tails = entry
                burst = [prefix + t for t in tails]
                inputs.append((prefix + wtail, burst, len(prefix)))
                refs.append([plain.generate(ids, args.new_tokens, timeout=args.request_timeout) for ids in burst])
                restorable.append(0)  # not a turn after a flush (counted in bursts= / burst_shared=)
                speakers.append(None)
                done += len(burst)
            else:
                _, agent, user = entry
                ids = history[agent] + user
                g = plain.generate(ids, args.new_tokens, timeout=args.request_timeout)
                inputs.append(ids)
                refs.append(g)
                speakers.append(agent)
                restorable.append(min(kept[agent], (len(ids) - 1) // CHECKPOINT * CHECKPOINT))
                history[agent] = ids + g.output_ids
                # the last token was sampled, never computed
                kept[agent] = kept_checkpoint(len(ids), len(ids) + len(g.output_ids) - 1)
                if len(history[agent]) > args.max_history:
                    history[agent] = list(systems[agent % 2])
                    kept[agent] = 0
                done += 1
            if before // 50 != done // 50:
                print(f"  reference {done}/{args.requests}", flush=True)

    # ---------------------------------------------------------------- phase 2
    requests = mismatches = hangs = restored = disagreements = 0
    flush_restored = flush_restorable = 0
    flushes = faults = aborts = restore_aborts = bursts = shared = 0
    short = short_damaged = 0  # restores after a flush shorter than restorable; of them, past a damaged page
    damaged: set[str] = set()  # page keys this soak damaged (any pool, any rank)
    max_dlogp = 0.0
    sessions = Sessions(args.explicit_sessions)
    t1 = time.monotonic()
    server = Server(config(True), work / "hicache.log", startup_timeout=args.startup_timeout)
    try:
        server.start()
        print(
            f"HiCache+L3 TP={args.tp} server up ({time.monotonic() - t1:.0f}s); soak",
            flush=True,
        )
        for i, ids in enumerate(inputs):
            if isinstance(ids, tuple):  # a burst
                writer, burst, plen = ids
                got = run_burst(
                    server,
                    store if mooncake is None else None,
                    writer,
                    burst,
                    plen,
                    args.new_tokens,
                    args.tp,
                    args.request_timeout,
                    get_hash_str,
                )
                bursts += 1
                for j, g in enumerate(got):
                    if not isinstance(g, Generation):
                        if VERIFY_FAIL in server.log_text():
                            disagreements += 1
                        else:
                            hangs += 1
                        print(f"  burst {i} request {j + 1}/{len(burst)}: {g!r}"[:400], flush=True)
                        break
                    requests += 1
                    restored += g.cached_storage
                    shared += j > 0 and g.cached_device >= plen
                    bad, dlogp = compare(g, refs[i][j], f"burst {i} request {j + 1}/{len(burst)}")
                    mismatches += bad
                    max_dlogp = max(max_dlogp, dlogp)
                else:
                    continue
                break
            agent = speakers[i]
            assert agent is not None
            extra = sessions.extra(agent)
            if args.p_hint and rng.random() < args.p_hint:
                others = [a for a in sessions.last if a != agent]
                target = rng.choice(others) if others and rng.random() < args.p_hint_other else agent
                wait = rng.random() < 0.5
                state = (
                    "drawn, not sent"
                    if args.hints_drawn_not_sent
                    else sessions.hint(server, target, wait=wait, timeout=args.request_timeout)
                )
                if args.trace:
                    print(f"  [{i}] hint agent {target} wait={wait}: {state}", flush=True)
            r = rng.random()
            flushed = r < args.p_flush
            if args.trace:
                what = ("flush", "fault", "abort", "abort-restore")
                edges = [args.p_flush, args.p_fault, args.p_abort, args.p_abort_restore]
                acc, act = 0.0, "-"
                for name, p in zip(what, edges, strict=True):
                    acc += p
                    if r < acc:
                        act = name
                        break
                print(f"  [{i}] turn of agent {agent} ({len(ids)} tokens, {extra}): {act}", flush=True)
            if flushed:
                server.flush_cache(timeout=args.request_timeout)
                flushes += 1
            elif r < args.p_flush + args.p_fault:
                key = fault(store, ids, rng, args.tp, get_hash_str)
                if key is not None:
                    faults += 1
                    damaged.add(key)
            elif r < args.p_flush + args.p_fault + args.p_abort:
                aborts += abort_copy(
                    server,
                    ids,
                    args.new_tokens,
                    rng,
                    f"soak-abort-{i}",
                    args.request_timeout,
                    extra=extra,
                )
            elif r < args.p_flush + args.p_fault + args.p_abort + args.p_abort_restore:
                # the device empty, so the copy restores from L3 (streamed when its hit is larger
                # than the host buffer): aborted at a random point after its restore began
                server.flush_cache(timeout=args.request_timeout)
                restore_aborts += abort_copy(
                    server,
                    ids,
                    args.new_tokens,
                    rng,
                    f"soak-abort-restore-{i}",
                    args.request_timeout,
                    after_log=STREAM_START,
                    extra=extra,
                )
            try:
                g = server.generate(ids, args.new_tokens, timeout=args.request_timeout, extra=extra)
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
                    # a page damaged by this soak between the restored end and the restorable
                    # one explains it ("damage costs only the damaged part")
                    keys = get_hash_str(ids[: restorable[i]], None, page_size=CHECKPOINT)
                    hit = [k for k in keys[g.cached_storage // CHECKPOINT :] if k in damaged]
                    short += 1
                    short_damaged += bool(hit)
                    why = f"a page damaged earlier: {hit[0][:12]}" if hit else "no damaged page in the lost part"
                    print(f"  short restore request {i}: {g.cached_storage} of {restorable[i]} ({why})", flush=True)
            bad, dlogp = compare(g, refs[i], f"request {i}")
            mismatches += bad
            max_dlogp = max(max_dlogp, dlogp)
            sessions.spoke(agent, ids + g.output_ids)
            if args.p_close and extra is not None and rng.random() < args.p_close:
                sessions.close(server, agent, timeout=args.request_timeout)
            if (i + 1) % 50 == 0:
                print(
                    f"  soak entry {i + 1}/{len(inputs)}: requests={requests} restored_tokens={restored}",
                    flush=True,
                )
        text = server.log_text()
        disagreements = max(disagreements, text.count(VERIFY_FAIL))
        abandoned = text.count("l3_wait_abandoned")
        leaks = text.count(LEAK)
        crashes = int(not server.alive())
    finally:
        server.stop()
        if mooncake is not None:
            mooncake.stop()
    print(
        f"soak_server: tp={args.tp} model={args.model or 'default'} backend={args.backend} agents={args.agents} seed={args.seed} flushes={flushes} "
        f"faults={faults} aborts={aborts} restore_aborts={restore_aborts} bursts={bursts} burst_shared={shared} "
        f"wait_abandoned={abandoned} max_logprob_diff={max_dlogp:.3g} "
        f"short_restores={short} short_after_damage={short_damaged} {sessions.summary()} "
        f"reference {t1 - t0:.0f}s, soak {time.monotonic() - t1:.0f}s, logs in {work}"
    )
    print(
        f"requests={requests} mismatches={mismatches} hangs={hangs} "
        f"restored_tokens={restored} rank_disagreements={disagreements} "
        f"restored_vs_restorable={flush_restored}/{flush_restorable} crashes={crashes} leaks={leaks}",
        flush=True,
    )
    wanted = args.requests if args.entries is None else sum(len(e[3]) if e[0] == "burst" else 1 for e in plan)
    failed = mismatches or hangs or disagreements or abandoned or sessions.errors
    return 1 if (failed or requests < wanted) else 0


def compare(g, want, what: str) -> tuple[int, float]:
    """(1 if the answer differs from the no-cache one, largest logprob difference)."""
    diffs = [abs(x - y) for x, y in zip(g.logprobs, want.logprobs, strict=False)]
    dlogp = max(diffs, default=0.0)
    if g.output_ids != want.output_ids or dlogp > 0.0:
        # output positions that differ: 0 is the prefill's token, later ones are decode steps
        where = [k for k, d in enumerate(diffs) if d > 0.0]
        print(
            f"  MISMATCH {what}: {g.output_ids} vs {want.output_ids} (dlogprob {dlogp:.3g} at output "
            f"positions {where}, {g.source}; no-cache: {want.source}; logprobs {g.logprobs} vs {want.logprobs})",
            flush=True,
        )
        return 1, dlogp
    return 0, dlogp


def stored(store: Path, ids: list[int], tp: int, get_hash_str) -> bool:
    """KV of every page of `ids` on every rank, and a Mamba checkpoint at the last one."""
    pages = store / "pages"
    if not pages.is_dir():
        return False
    names = set(os.listdir(pages))
    keys = get_hash_str(ids[: len(ids) // 64 * 64], None, page_size=64)
    if not keys:
        return False

    def has(key: str, pool: str, rank: int) -> bool:
        return any(n.startswith(f"{key}.{pool}-") and n.endswith(f".r{rank}of{tp}.bin") for n in names)

    return all(all(has(k, "kv", r) for k in keys) and has(keys[-1], "mamba", r) for r in range(tp))


class Sessions:
    """Phase 2's session side: explicit session ids, hints, closes, and what they returned."""

    def __init__(self, explicit: int):
        self.explicit = explicit
        self.last: dict[int, list[int]] = {}  # agent -> its last context (input + output)
        self.states: dict[str, int] = {}  # hint outcome -> count
        self.closes = 0
        self.errors = 0

    def sid(self, agent: int) -> str | None:
        return f"soak-agent-{agent}" if agent < self.explicit else None

    def extra(self, agent: int) -> dict | None:
        sid = self.sid(agent)
        return {"session_id": sid} if sid else None

    def spoke(self, agent: int, context: list[int]) -> None:
        self.last[agent] = context

    def _count(self, state: str) -> None:
        self.states[state] = self.states.get(state, 0) + 1

    def _error(self, what: str) -> None:
        self.errors += 1
        print(f"  HINT ERROR {what}"[:400], flush=True)

    def hint(self, server, agent: int, wait: bool, timeout: float) -> str:
        """A speaks-next hint for `agent`'s last context (by session id when it has one);
        when `wait`, poll it until it settles."""
        if agent not in self.last:
            return "no context yet"
        sid = self.sid(agent)
        body: dict = {"session_id": sid} if sid else {"input_ids": self.last[agent]}
        status, out = server.post("/sglang_l3/prefetch", body, timeout=timeout)
        if status != 200 or not isinstance(out, dict) or "hint_id" not in out:
            self._error(f"agent {agent} {body.get('session_id') or 'input_ids'}: HTTP {status} {out}")
            return f"HTTP {status}"
        self._count("joined" if out.get("joined") else "sent")
        if not wait:
            return f"{out.get('state')} {out['hint_id']}"
        deadline = time.monotonic() + timeout
        state = out.get("state")
        while state == "staging" and time.monotonic() < deadline:
            time.sleep(0.05)
            out = json.loads(server.get_text(f"/sglang_l3/prefetch/{out['hint_id']}", timeout=timeout))
            state = out.get("state")
        self._count(str(state))
        if state not in ("landed", "deferred_device_full", "not_restorable"):
            self._error(f"agent {agent}: hint ended {state}: {out}")
        return f"{state} {out}"

    def close(self, server, agent: int, timeout: float) -> None:
        status, out = server.post("/close_session", {"session_id": self.sid(agent)}, timeout=timeout)
        if status != 200:
            self._error(f"close agent {agent}: HTTP {status} {out}")
        self.closes += 1

    def summary(self) -> str:
        states = ",".join(f"{k}:{v}" for k, v in sorted(self.states.items())) or "none"
        return f"hints={states} closes={self.closes} hint_errors={self.errors}"


def run_burst(
    server,
    store: Path | None,
    writer: list[int],
    burst: list[list[int]],
    plen: int,
    new_tokens: int,
    tp: int,
    timeout: float,
    get_hash_str,
) -> list:
    """Write the prefix to L3 (the writer request), flush the device, then send the burst:
    the first request, and the others once its streamed restore has started (5 s at most).
    `store`: the file store's directory, polled for the prefix's pages; None (Mooncake):
    not polled. Returns per request a Generation or the exception (a hang: no answer
    within `timeout`)."""
    server.generate(writer, new_tokens, timeout=timeout)
    prefix = writer[:plen]
    deadline = time.monotonic() + 60
    while store is not None and not stored(store, prefix, tp, get_hash_str) and time.monotonic() < deadline:
        time.sleep(0.2)  # write-through is asynchronous; a prefix not in L3 in time just computes
    server.flush_cache(timeout=timeout)
    out: list = [None] * len(burst)

    def send(j: int) -> threading.Thread:
        def run() -> None:
            try:
                out[j] = server.generate(burst[j], new_tokens, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - reported as a hang by the caller
                out[j] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    mark = len(server.log_text())
    threads = [send(0)]
    until = time.monotonic() + 5
    while not STREAM_START.search(server.log_text()[mark:]) and time.monotonic() < until:
        time.sleep(0.05)
    threads += [send(j) for j in range(1, len(burst))]
    for t in threads:
        t.join(timeout + 30)
    return [g if g is not None else TimeoutError("no answer") for g in out]


def fault(store: Path, ids: list[int], rng: random.Random, tp: int, get_hash_str) -> str | None:
    """Damage one rank's page file of the next request's prefix (or any page); returns
    the damaged page's key, None if nothing was damaged."""
    pages = store / "pages"
    if not pages.is_dir():
        return None
    keys = get_hash_str(ids[: len(ids) // 64 * 64], None, page_size=64)
    rank = rng.randrange(tp)
    mine = [p for p in pages.glob(f"*.r{rank}of{tp}.bin")]
    wanted = [p for p in mine if p.name.split(".", 1)[0] in set(keys)] or mine
    if not wanted:
        return None
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
        return None
    return victim.name.split(".", 1)[0]


def abort_copy(
    server,
    ids: list[int],
    new_tokens: int,
    rng: random.Random,
    rid: str,
    timeout: float,
    after_log: re.Pattern | None = None,
    extra: dict | None = None,
) -> int:
    """Send a copy of the next request and abort it after a random short delay (counted
    from the first new server log line matching `after_log`, when given: at most 5 s)."""
    box: dict = {}
    mark = len(server.log_text())

    def run() -> None:
        try:
            box["g"] = server.generate(ids, new_tokens * 8, timeout=timeout, rid=rid, extra=extra)
        except Exception as e:  # noqa: BLE001 - an aborted stream may end in any way
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    if after_log is not None:
        deadline = time.monotonic() + 5.0
        while not after_log.search(server.log_text()[mark:]) and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
    else:
        time.sleep(rng.uniform(0.0, 1.5))
    with contextlib.suppress(OSError, urllib.error.URLError):
        server.abort(rid)
    t.join(timeout)
    return 1


if __name__ == "__main__":
    sys.exit(main())
