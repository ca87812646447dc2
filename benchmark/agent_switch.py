#!/usr/bin/env python3
"""The agent switch at real per-rank geometry: two agents share one device pool, and
every time the other agent speaks its context comes back from L3 while the last
speaker's newest pages are still being written (issue 50 item 1).

One rank of Qwen3.5-27B at TP=2 (restore_bench's geometry and helpers: KV 32,768
B/token, GDN state 76,972,032 B), through the real upstream cache stack
(`sglang_l3.testing.stack.L3Stack`: UnifiedRadixCache + HybridCacheController +
buffer-only HiCache with upstream's write-through) and our store (patch store-file),
with every hicache and storage patch of the series (streamed-restore, write-guard, ...).
--device cpu (default): the CPU stand-in, whose host->device copies are memcpys on
the cores that also read the store; --device cuda: the device pools on a CUDA/ROCm
GPU, upstream's load/write streams real (restore_bench's `prepare`; on the lent GPU
machine `test/gpu/cache_check.sh` runs it).

Setup (untimed): agent B's context (--context tokens) is written through to L3 and
evicted: it is in L3 only. Agent A's context (--context minus half a turn) is
written through and stays on the device. Host staging buffer: --buffer x the
context (default 1/4). The device pool is sized for the longest context of the run;
before each switch every free row but one page is held (a stand-in for other
requests' rows), so the pool holds the resident context plus one page.
Memory: the run's estimate (`need_gib`: the device pool, the host buffer, the store
read's stack, both stacks' Mamba pools) must fit MemAvailable - 2 GiB (or --max-gib),
as restore_bench's rows; otherwise it prints `skipped` and exits 1 (131072 tokens
need ~8.9 GiB).

One switch (X resident, Y arriving; A then B then A ...):
1. untimed: the store's own cold read of what Y's restore reads (every KV page and
   the last page's Mamba state, with the restore's two readers: restore_bench's
   like-for-like baseline, `measure_store_read`), right before the switch;
2. untimed: X decodes a turn (--turn tokens): its new KV rows and Mamba state are
   inserted into the tree as upstream's `cache_finished_req` does, and upstream's
   write-through queues their L3 write (held on the device by patch write-guard
   until staged, by upstream's lock until the device->host copy is acked);
3. page cache dropped, free device rows and Mamba slots scribbled;
4. timed (as restore_bench's timer): Y arrives (`prefetch_from_storage`) and comes
   back (the streamed restore: store reads, host->device copies, scheduler stand-in
   ticks, admission `init_load_back`, the forward's per-layer waits, the ack). The
   arriving context is half a turn longer than the resident one was before its
   turn, so Y's restore needs X's newest rows: they are evictable only once X's
   turn is staged for L3 (a hit that is ready before then is parked, holding
   nothing), and X's write reaches the disk while Y's pieces are read.
5. untimed: every restored row and both Mamba slots checked
   (`L3Stack.verify_restored`, the `exact` column); the write-through drained; X's
   turn (its KV pages and the Mamba state at its last page) looked up in the store
   (`x_in_l3`).

Per switch: switch seconds, the store read's seconds, `vs_store` = switch / store
read (lower is better; 1.0 = as fast as the store reads the same bytes);
`wait_ms` (`write_wait_ms`): Y's arrival -> the tick at which X's newest rows stopped
being held by their write (patch write-guard while queued, upstream's lock until the
device->host copy is acked): Y's restore needs those rows and cannot start earlier;
`start_ms`: arrival -> the tick Y's stream started (>= wait_ms; also the store's
existence check of Y's pages); `parked`: whether the streamed restore parked Y for
rows held by X's write (`l3_stream_restore{waited_write}`: the write had not
released them when Y's hit was ready); CPU seconds per GiB of the switch and of the
store read; exact; X's turn in the store right after Y's admission (`l3@admit`) and
after the write-through drained (`x_in_l3`). Then the medians over --switches
switches (the median row's vs_store is the median of the switches' ratios).

The guard (`make bench-check`): --max-ratio X exits 1 when the median vs_store is
above X, a switch is not exact, or a resident's turn is missing from L3.
--check-inside-timer is its negative control (the test harness's forward-time read
inside the timer, as restore_bench's). A switch that is not exact, or whose turn is
missing from L3, prints (stderr) the sglang-l3 log records of its restore (a stream's
start, waits, aborts and their reasons) and the counters the switch moved.

Last line exactly

  switch_vs_store=R write_wait_ms=W a_pages_in_l3=yes|no exact=yes|no switches=N context=C

R and W: medians over the switches (vs_store, wait_ms); a_pages_in_l3: every
resident's turn was in L3 after its switch; exact: every switch's rows and states.

Example: nice -n 10 python benchmark/agent_switch.py --context 32768 --switches 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import restore_bench as rb  # noqa: E402  (benchmark/ is not a package)

PAGE = rb.PAGE
MODEL = "Qwen3.5-27B"


def tokens(agent: int, n: int) -> list[int]:
    """Agent `agent`'s conversation, first `n` tokens (a turn extends it)."""
    step = (7919, 7907)[agent]
    return [(i * step + 13 * agent) % 150_000 + 1 for i in range(n)]


def lengths(context: int, turn: int, switches: int) -> list[tuple[int, int]]:
    """(resident's length after its turn, arriving's length) per switch. A starts half
    a turn shorter than B, so each arriving context is half a turn longer than the
    resident one was before its turn: the restore needs the resident's newest rows."""
    length = [context - turn // 2, context]
    out = []
    for k in range(switches):
        x, y = k % 2, 1 - k % 2
        length[x] += turn
        out.append((length[x], length[y]))
    return out


def path_keys(st: Any, node: Any) -> list[str]:
    """The store keys of every page on the path to `node` (root first)."""
    core = st.cache.tree_core
    return list(core.get_prefix_hash_values(node)) + list(core.get_hash_values(node))


def decode_turn(st: Any, old: list[int], new: list[int], marker: float) -> Any:
    """X decoded a turn: the new tokens' KV rows (fill_kv's values at their positions)
    and the Mamba state after `new` go into the tree as upstream's cache_finished_req
    puts them, the context's rows first (the tree's own, protected: nothing to free); upstream's
    write-through queues the new node's L3 write. Returns the new node."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    m = st.match(old)
    if m.device_prefix_len != len(old):
        raise RuntimeError(f"the resident context is not on the device ({m.device_prefix_len} of {len(old)})")
    rows = st.cache.path_device_indices(m.last_device_node)
    added = st.allocator.alloc(len(new) - len(old))
    slot = st.req_to_token_pool.mamba_allocator.alloc(1)
    if added is None or slot is None:
        raise RuntimeError("device pool exhausted by the turn")
    slot = slot.reshape(-1)[:1]
    st.fill_kv(added, new[len(old) :], len(old))
    mc = st.mamba_cache
    for i, t in enumerate([mc.temporal, *mc.conv]):
        t[:, slot] = st.state_value(new, marker, i)
    value = torch.cat([rows.to(added.dtype), added])
    # prev_prefix_len: the context's rows are the tree's (upstream frees the overlap past it as duplicates)
    st.cache.insert(InsertParams(key=st.key(new), value=value, mamba_value=slot.reshape(1), prev_prefix_len=len(old)))
    m = st.match(new)
    if m.device_prefix_len != len(new):
        raise RuntimeError(f"the turn's insert matched {m.device_prefix_len} of {len(new)}")
    return m.last_device_node


def scribble_free(st: Any) -> None:
    """Overwrite every free device KV row and free Mamba slot (a restore that reads a
    row or slot it did not write fails `exact`, even where an earlier context of the
    same agent left the same values there)."""
    alloc = st.allocator
    pages = alloc.get_all_free_pages().long()
    rows = (pages.view(-1, 1) * PAGE + torch.arange(PAGE, device=pages.device).view(1, -1)).reshape(-1)
    kv = st.kv_pool
    for layer in range(kv.start_layer, kv.start_layer + kv.layer_num):
        kv.get_key_buffer(layer)[rows] = -7
        kv.get_value_buffer(layer)[rows] = -7
    slots = torch.as_tensor(st.req_to_token_pool.mamba_allocator.free_slots).long()
    mc = st.mamba_cache
    for t in [mc.temporal, *mc.conv]:
        t[:, slots] = -7


def in_store(st: Any, keys: list[str]) -> bool:
    """Every KV page of `keys` and the Mamba state at the last one are in the store."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    be = st.cache.cache_controller.storage_backend
    kv = be.store.pool_spec(be.pool_layout(PoolName.KV))
    state = be.store.pool_spec(be.pool_layout(PoolName.MAMBA))
    return all(be.store.exists([(k, kv) for k in keys] + [(keys[-1], state)]))


class SwitchLog(logging.Handler):
    """sglang-l3's own log records (INFO and up: a stream's start, a wait, an abort and
    its reason) of the switch in progress, kept in memory and printed only when the switch
    fails, with the counters it moved: a failure in CI explains itself. Nothing else is
    shown (prepare() silences library logging for a clean table)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(relativeCreated)9.1f ms %(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def attach(self) -> None:
        logging.getLogger().addHandler(logging.NullHandler())  # no last-resort printing
        ours = logging.getLogger("sglang_l3")
        ours.setLevel(logging.INFO)
        ours.propagate = False
        ours.addHandler(self)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Records while the switch runs (prepare() disabled logging; other libraries'
        loggers, torch's included, stay quiet below CRITICAL at the root)."""
        self.lines.clear()
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.CRITICAL)
        logging.disable(logging.NOTSET)
        try:
            yield
        finally:
            logging.disable(logging.WARNING)
            root.setLevel(level)

    def report(self, label: str, before: dict, after: dict) -> None:
        moved = {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] != before.get(k, 0)}
        rb.log(f"  switch {label} failed; counters moved: {moved}")
        for line in self.lines[-40:]:
            rb.log(f"    {line}")


@dataclasses.dataclass
class Switch:
    resident: str
    arriving: str
    tokens: int
    bytes: int
    wall: float
    cpu: float
    store_wall: float
    store_cpu: float
    ratio: float  # wall / store_wall
    write_wait_ms: float
    parked: str
    start_ms: float
    exact: bool
    x_in_l3_at_admit: bool
    x_in_l3: bool


def run(args: argparse.Namespace, store: str) -> list[Switch]:
    from sglang.srt.server_args import set_global_server_args_for_scheduler
    from sglang_l3 import metrics
    from sglang_l3.patches.hicache import write_guard
    from sglang_l3.patches.hicache.streamed_restore import lane_of
    from sglang_l3.testing.stack import L3Stack, RestoreFailed

    m = next(x for x in rb.MODELS if x.name == MODEL)
    marker = rb.WRITE_MARKER
    plan = lengths(args.context, args.turn, args.switches)
    longest = max(max(a, b) for a, b in plan)
    spec = dataclasses.replace(
        rb.hybrid_spec(m, longest), kv_size=longest + 2 * PAGE, max_context_len=longest + 2 * PAGE
    )
    buf = max(PAGE, int(args.buffer * args.context) // PAGE * PAGE)
    names = ("A", "B")
    seqs = [tokens(0, args.context - args.turn // 2), tokens(1, args.context)]
    out: list[Switch] = []
    trace = SwitchLog()
    trace.attach()
    with L3Stack(spec, store, server_args=rb.buffer_args(spec, buf), host_budget_bytes=rb.host_budget()) as st:
        cc = st.cache.cache_controller
        cc.prefetch_capacity_limit = int(0.9 * cc.mem_pool_host.size)  # upstream's limit
        pipe = st.cache.buffer_pipeline
        st.scribble()  # faults the device pools in (a serving process's are resident)
        rb.touch_host_pools(cc)
        keys: list[list[str]] = [[], []]
        rb.log(f"[{MODEL} {args.context}] writing B ({len(seqs[1])} tokens), then A ({len(seqs[0])}) ...")
        for agent in (1, 0):
            st.write(seqs[agent], marker=marker)
            st.settle(timeout=3600)
            keys[agent] = path_keys(st, st.match(seqs[agent]).last_device_node)
            if agent == 1:
                st.evict_all()
                st.settle()
        if st.match(seqs[1]).device_prefix_len:
            raise RuntimeError("B is still on the device after the eviction")
        for k, (len_x, _) in enumerate(plan):
            x, y = k % 2, 1 - k % 2
            rb.log(f"[{MODEL} {args.context}] switch {k + 1}: {names[x]} decodes {args.turn}, {names[y]} arrives")
            # 1. the store's own read of what Y's restore reads, right before
            base = rb.measure_store_read(m, keys[y], store)
            if base["pages"] != len(keys[y]) or not base["state"]:
                raise RuntimeError(f"the store read {base['pages']} of {len(keys[y])} pages of {names[y]}")
            set_global_server_args_for_scheduler(st.server_args)  # the baseline's stack set its own
            # 2. X decodes a turn; its L3 write is queued
            old, seqs[x] = seqs[x], tokens(x, len_x)
            turn_node = decode_turn(st, old, seqs[x], marker)
            turn_keys = list(st.cache.tree_core.get_hash_values(turn_node))
            if len(turn_keys) != args.turn // PAGE:
                raise RuntimeError(f"the turn's node has {len(turn_keys)} page keys, {args.turn // PAGE} expected")
            keys[x] = path_keys(st, turn_node)
            # 3. the pool holds the resident context plus one page; cold disk
            free = st.allocator.available_size()
            pad = st.allocator.alloc(free - PAGE) if free > PAGE else None
            rb.drop_page_cache(store)
            scribble_free(st)
            # 4. Y arrives (timed)
            c0 = metrics.snapshot()
            seen: dict[str, float] = {}

            def observe(h: Any, c0: dict = c0, seen: dict = seen) -> None:
                now = time.perf_counter()
                seen.setdefault("first_tick", now)
                snap = metrics.snapshot()
                for what in ("write", "busy"):
                    key = f"l3_stream_restore{{waited_{what}}}"
                    if what not in seen and snap.get(key, 0) > c0.get(key, 0):
                        seen[what] = now
                if "released" not in seen and not write_guard.write_held_tokens(pipe) and not pipe.pending_write_queue:
                    seen["released"] = now
                if "started" not in seen and h in lane_of(pipe).streams:
                    seen["started"] = now

            c_0, t0 = time.process_time(), time.perf_counter()
            with trace.capture():
                try:
                    req, loaded = rb.restore_busy(st, seqs[y], check_forward=args.check_inside_timer, on_tick=observe)
                except RestoreFailed as e:
                    rb.log(f"  restore failed: {e}")
                    req, loaded = None, 0
            wall, cpu = time.perf_counter() - t0, time.process_time() - c_0
            # 5. checks
            at_admit = in_store(st, turn_keys)
            exact = False
            if req is not None:
                try:
                    st.verify_restored(seqs[y], req, loaded, marker)
                    exact = loaded == len(seqs[y])
                except RestoreFailed as e:
                    rb.log(f"  not exact: {e}")
                st.release(req)
            if pad is not None:
                st.allocator.free(pad)
            st.settle(timeout=3600)
            x_in_l3 = in_store(st, turn_keys)
            if not (exact and x_in_l3):
                trace.report(f"{k + 1} ({names[x]}->{names[y]}, {loaded} tokens restored)", c0, metrics.snapshot())
            ms = {k: (v - t0) * 1e3 for k, v in seen.items()}
            rb.log(f"  ms from arrival: { {k: round(v, 1) for k, v in ms.items()} }")
            started = ms.get("started", wall * 1e3)
            # Y's restore needs X's newest rows: it cannot have them before their write
            # releases them (write-guard while queued, upstream's lock until the
            # device->host copy is acked), whether or not the stream was ready earlier
            wait_ms = ms.get("released", wall * 1e3)
            out.append(
                Switch(
                    resident=names[x],
                    arriving=names[y],
                    tokens=loaded,
                    bytes=loaded * m.kv_bytes_per_token() + (m.state_bytes() if loaded else 0),
                    wall=wall,
                    cpu=cpu,
                    store_wall=base["wall"],
                    store_cpu=base["cpu"],
                    ratio=wall / base["wall"] if base["wall"] > 0 else math.nan,
                    write_wait_ms=max(0.0, wait_ms),
                    parked="write" if "write" in ms else "busy" if "busy" in ms else "no",
                    start_ms=started,
                    exact=exact,
                    x_in_l3_at_admit=at_admit,
                    x_in_l3=x_in_l3,
                )
            )
            print_row(k + 1, out[-1], args.context)
        del st
    rb.free_memory()
    return out


HEADER = (
    f"{'switch':>6s} {'X->Y':>5s} {'context':>8s} {'tokens':>8s} {'bytes':>12s} {'switch_s':>8s} {'store_s':>8s} "
    f"{'vs_store':>8s} {'wait_ms':>8s} {'start_ms':>8s} {'parked':>6s} {'cpu_s/GiB':>9s} {'store_cpu':>9s} "
    f"{'exact':>5s} {'l3@admit':>8s} {'x_in_l3':>7s}"
)


def print_row(label: Any, s: Switch, context: int) -> None:
    gib = s.bytes / 2**30 if s.bytes else math.nan
    print(
        f"{label!s:>6s} {s.resident + '->' + s.arriving:>5s} {context:>8d} {s.tokens:>8d} {s.bytes:>12d} "
        f"{s.wall:>8.3f} {s.store_wall:>8.3f} {s.ratio:>8.2f} {s.write_wait_ms:>8.1f} {s.start_ms:>8.1f} "
        f"{s.parked:>6s} {s.cpu / gib:>9.2f} {s.store_cpu / gib:>9.2f} "
        f"{s.exact!s:>5s} {s.x_in_l3_at_admit!s:>8s} {s.x_in_l3!s:>7s}",
        flush=True,
    )


def need_gib(context: int, turn: int, switches: int, buffer: float) -> float:
    """Peak memory: the device pool for the longest context + the host buffer + the
    store read's stack (restore_bench's: two 128-page regions, device and host) and
    both stacks' Mamba pools."""
    from sglang_l3.patches.hicache.streamed_restore import MAX_INFLIGHT, READ_BATCH_PAGES

    m = next(x for x in rb.MODELS if x.name == MODEL)
    longest = max(max(a, b) for a, b in lengths(context, turn, switches))
    region = 2 * MAX_INFLIGHT * min(longest // PAGE, READ_BATCH_PAGES) * PAGE
    kv = m.kv_bytes_per_token() * (longest + 2 * PAGE + int(buffer * context) + region)
    return (kv + 2 * rb.STATE_OVERHEAD * m.state_bytes()) / 2**30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=131072, help="tokens per agent context (default 131072)")
    ap.add_argument("--turn", type=int, default=1024, help="tokens a resident agent decodes before each switch")
    ap.add_argument("--switches", type=int, default=4, help="switches back and forth (A->B, B->A, ...)")
    ap.add_argument("--buffer", type=float, default=0.25, help="host staging buffer, fraction of the context")
    ap.add_argument("--dir", default=None, help="store directory (default: a temp dir, removed)")
    ap.add_argument(
        "--max-gib", type=float, default=None, help="memory budget (default: MemAvailable - 2 GiB, as restore_bench)"
    )
    ap.add_argument(
        "--max-ratio",
        type=float,
        default=None,
        help="the guard (`make bench-check`): exit 1 when the median switch/store time is above this, "
        "a switch is not exact, or a resident's turn is missing from L3",
    )
    ap.add_argument(
        "--check-inside-timer",
        action="store_true",
        help="negative control of the guard: the test harness's forward-time read inside the timer",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the device pools live: cpu (the CPU stand-in) or cuda (a CUDA/ROCm GPU: real copy engine)",
    )
    args = ap.parse_args(argv)
    if args.context % PAGE or args.turn % (2 * PAGE) or args.turn // 2 <= PAGE:
        ap.error(f"--context must be a multiple of {PAGE}, --turn a multiple of {2 * PAGE} and at least {4 * PAGE}")
    if args.turn // 2 >= args.context or args.switches < 1:
        ap.error("--turn must be under twice the context, --switches at least 1")

    rb.prepare(args.device)
    m = next(x for x in rb.MODELS if x.name == MODEL)
    need = need_gib(args.context, args.turn, args.switches, args.buffer)
    budget = f"--max-gib {args.max_gib:.1f} GiB" if args.max_gib else "MemAvailable - 2 GiB"
    print(
        f"# {MODEL}, one rank of TP={rb.TP}, page {PAGE}: KV {m.kv_bytes_per_token()} B/token, "
        f"GDN state {m.state_bytes()} B; context {args.context}, turn {args.turn}, host buffer "
        f"{args.buffer:g} x context; ~{need:.1f} GiB ({budget}); device {rb.device_name(args.device)}"
    )
    if not rb.fits(need, args.max_gib):
        print(f"skipped: needs ~{need:.1f} GiB > budget")
        print(f"switch_vs_store=nan write_wait_ms=nan a_pages_in_l3=no exact=no switches=0 context={args.context}")
        return 1
    print(HEADER, flush=True)
    root = args.dir or tempfile.mkdtemp(prefix="agent-switch-")
    store = os.path.join(root, f"{MODEL}-{args.context}")
    try:
        switches = run(args, store)
    finally:
        shutil.rmtree(store, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    ratio = statistics.median(s.ratio for s in switches)
    wait = statistics.median(s.write_wait_ms for s in switches)
    med = Switch(
        resident="",
        arriving="",
        tokens=int(statistics.median(s.tokens for s in switches)),
        bytes=int(statistics.median(s.bytes for s in switches)),
        wall=statistics.median(s.wall for s in switches),
        cpu=statistics.median(s.cpu for s in switches),
        store_wall=statistics.median(s.store_wall for s in switches),
        store_cpu=statistics.median(s.store_cpu for s in switches),
        ratio=ratio,
        write_wait_ms=wait,
        parked=f"{sum(s.parked == 'write' for s in switches)}/{len(switches)}",
        start_ms=statistics.median(s.start_ms for s in switches),
        exact=all(s.exact for s in switches),
        x_in_l3_at_admit=all(s.x_in_l3_at_admit for s in switches),
        x_in_l3=all(s.x_in_l3 for s in switches),
    )
    print_row("median", med, args.context)
    problems = []
    if args.max_ratio is not None:
        if not ratio <= args.max_ratio:
            problems.append(f"median switch/store {ratio:.2f} > {args.max_ratio:.2f}")
        if not med.exact:
            problems.append("a switch is not exact")
        if not med.x_in_l3:
            problems.append("a resident's turn is missing from L3 after its switch")
        for p in problems:
            print(f"bench-check FAILED: {p}")
        if not problems:
            print(
                f"bench-check passed: every switch exact, every turn in L3, switch/store {ratio:.2f} <= {args.max_ratio}"
            )
    yes = {True: "yes", False: "no"}
    print(
        f"switch_vs_store={ratio:.2f} write_wait_ms={wait:.1f} a_pages_in_l3={yes[med.x_in_l3]} "
        f"exact={yes[med.exact]} switches={len(switches)} context={args.context}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
