"""Issue 24 through real servers: two and three requests for one long prefix that is in
L3 only, the later ones arriving while the first one's streamed restore is in flight,
on a device pool too short for two copies of the prefix. Before patch `stream-share`
the second request started a second, truncated restore (`truncated_device`), the
first one's staged hold was dropped after 32 deferrals, and neither was ever answered.

The issue's settings: page 64, `--max-total-tokens 4096`, a 384-token host buffer
(`--hicache-ratio 0.09`), a 2176-token prefix written to L3 and flushed from the
device, X1/X2/X3 of 2374/2394/2414 tokens; TP=1 and TP=2, each prefetch policy. The
test fault `SGLANG_L3_TEST_FAULT=stream-hold@GATE` holds X1's stream (no piece read)
until the server logs that the other requests' hits are parked behind it, so they
always meet it in flight. Every answer (tokens and logprobs) must equal a no-cache
server's of the same TP size; X1 restores the prefix from L3 and X2/X3 share it from
the device tree (not with `best_effort`, which stops a stream at its first poll and
recomputes); SGLANG_L3_VERIFY=1 (ranks compare every restore; the L3 wait watchdog
must never fire). `test_tp2_watchdog_ends_the_hang`: with `stream-share` disabled the
hang is back, and the watchdog (SGLANG_L3_VERIFY=1, a 5 s margin) ends it on both
ranks alike, logging both ranks' state; the answers are still right.

Servers: per TP one no-cache reference (stopped once its answers are taken), then one
L3 server per case over a copy of one store (the first writes the prefix): all three
policies at TP=1 and at TP=2, plus the watchdog's. One TP=2 server at a time (two shared
cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from l3_e2e import PAGE_SIZE, PREFETCH_THRESHOLD, STARTUP_TIMEOUT, wait_log
from sglang_l3.testing.server import Generation, Server, ServerConfig, prompt
from tp2_e2e import DEVICE, REQUEST_TIMEOUT, TEST_BOUND, Hang, bounded, flush, generate, page_keys, same_output

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POOL = 4096
HOST_RATIO = 0.09  # host KV pool 384 tokens
CHUNK = 256
PREFIX = prompt(24, 2176)
WRITER = PREFIX + prompt(25, 40)  # computing it writes KV and Mamba checkpoints up to 2176
# X1, X2(, X3) of 2374, 2394(, 2414) tokens; a burst's own tails: its requests' pages written
# through by an earlier burst would make a later one's hit longer than the prefix
BURSTS = {n: [PREFIX + prompt(10 * n + i, 198 + 20 * i) for i in range(n)] for n in (2, 3)}
NEW = 8
# prompts L3 does not hold (one per abort case), each needing more rows than the pool has
# beside a streamed PREFIX
FRESH = [prompt(90 + j, 2432) for j in range(5)]
# how long a request may wait while an aborted stream's reads hang (the fault holds them 120 s)
FRESH_TIMEOUT_S = 45.0
POLICIES = ("best_effort", "wait_complete", "timeout")
WATCHDOG = "l3_wait_abandoned"
VERIFY_FAIL = "TP ranks made different L3 restore decisions"
STREAM_START = re.compile(r"streamed restore req=(\S+) start=")
STOP_BEST_EFFORT = re.compile(r"streamed restore aborted req=(\S+) reason=stop_best_effort landed=(\d+/\d+)")


class Burst:
    """Per TP size: the reference answers and the store the L3 servers share."""

    def __init__(self, root: Path, tp: int):
        self.root, self.tp = root, tp
        self.snapshot = root / "prefix-store"  # the prefix alone, copied for every L3 server
        self.gate = root / "stream-hold.gate"
        self.ref: dict[int, list[Generation]] = {}
        self.fresh_ref: list[Generation] = []  # FRESH's answers, same server

    def store(self, name: str) -> Path:
        """A fresh store for one server: a copy of the prefix-only store once it exists."""
        store = self.root / f"store-{name}"
        shutil.rmtree(store, ignore_errors=True)
        if self.snapshot.is_dir():
            shutil.copytree(self.snapshot, store)
        return store

    def config(self, store: Path | None, policy: str = "timeout", env: dict | None = None) -> ServerConfig:
        extra = ["--hicache-ratio", str(HOST_RATIO), "--hicache-storage-prefetch-policy", policy] if store else []
        return ServerConfig(
            storage_dir=str(store) if store else None,
            device=DEVICE,
            tp_size=self.tp,
            max_total_tokens=POOL,
            chunked_prefill_size=CHUNK,
            page_size=PAGE_SIZE,
            prefetch_threshold=PREFETCH_THRESHOLD if store else None,
            # the `timeout` budget a loaded 2-core box cannot miss (the hang is not a deadline)
            storage_extra_config={"prefetch_timeout_base": 600} if store and policy == "timeout" else {},
            extra_args=extra,
            overlap_schedule=store is not None,  # the no-cache reference schedules without overlap
            env={"SGLANG_L3_VERIFY": "1", "SGLANG_L3_TEST_FAULT": f"stream-hold@{self.gate}", **(env or {})},
        )

    def reference(self) -> dict[int, list[Generation]]:
        if not self.ref:
            with (
                Server(self.config(None), self.root / "nocache.log", startup_timeout=STARTUP_TIMEOUT) as s,
                bounded(TEST_BOUND, f"no-cache TP={self.tp} reference", lambda: [s]),
            ):
                for n, xs in BURSTS.items():
                    self.ref[n] = [generate(s, ids, NEW, f"reference X{i + 1}/{n}") for i, ids in enumerate(xs)]
                self.fresh_ref = [generate(s, ids, NEW, f"reference fresh {j}") for j, ids in enumerate(FRESH)]
            assert all(len(set(g.output_ids)) > 1 for gs in self.ref.values() for g in gs), "degenerate weights"
        return self.ref

    def stored(self, store: Path) -> bool:
        """KV of every prefix page and the Mamba checkpoint at its end, on every rank."""
        pages = store / "pages"
        if not pages.is_dir():
            return False
        names = set(os.listdir(pages))
        keys = page_keys(PREFIX, PAGE_SIZE)

        def has(key: str, pool: str, rank: int) -> bool:
            return any(n.startswith(f"{key}.{pool}-") and n.endswith(f".r{rank}of{self.tp}.bin") for n in names)

        return all(
            all(has(k, "kv", r) for k in keys) and has(keys[-1], "mamba", r) for r in range(self.tp)
        )  # fmt: skip

    def write_prefix(self, s: Server, store: Path) -> None:
        """The first L3 server writes the prefix (then snapshotted); later ones start with it."""
        if not self.snapshot.is_dir():
            generate(s, WRITER, NEW, "writer")
            deadline = time.monotonic() + 300
            while not self.stored(store):
                assert time.monotonic() < deadline, "the prefix never reached L3"
                time.sleep(0.5)
            tmp = self.root / "prefix-store.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            # the server may still be writing other pages (the answer's): its staging files
            # come and go, published pages are renamed in whole
            shutil.copytree(store, tmp, ignore=lambda d, names: ["tmp"] if Path(d) == store else [])
            os.replace(tmp, self.snapshot)
        assert self.stored(store)


_BURSTS: dict[int, Burst] = {}


@pytest.fixture
def burst(request, tmp_path_factory, hash_extension_built) -> Burst:
    from sglang_l3.cpu import accelerator_present

    tp = request.param
    if DEVICE == "cpu" and accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    if DEVICE != "cpu":
        import torch

        if torch.cuda.device_count() < tp:
            pytest.skip(f"TP={tp} on {DEVICE} needs {tp} GPUs")
    if tp not in _BURSTS:
        _BURSTS[tp] = Burst(tmp_path_factory.mktemp(f"burst-tp{tp}"), tp)
    return _BURSTS[tp]


def _send(s: Server, ids: list[int], what: str, out: dict, key: int) -> threading.Thread:
    def run() -> None:
        try:
            out[key] = s.generate(ids, NEW, timeout=REQUEST_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - reported by the caller with the log
            out[key] = e

    t = threading.Thread(target=run, name=what, daemon=True)
    t.start()
    return t


def run_burst(b: Burst, s: Server, n: int, policy: str, *, streamed: bool = True) -> list[Generation]:
    """Flush, then X1 and, once its stream is held in flight with n hits parked, X2..Xn."""
    flush(s, f"flush before the burst of {n}")
    xs = BURSTS[n]
    mark = len(s.log_text())
    b.gate.touch()
    out: dict = {}
    threads = [_send(s, xs[0], "X1", out, 0)]
    try:
        if streamed:
            wait_log(s, mark, r"streamed restore req=\S+ start=", "X1's stream to start", error=Hang)
        threads += [_send(s, xs[i], f"X{i + 1}", out, i) for i in range(1, n)]
        if streamed:
            wait_log(s, mark, rf"hits parked={n}\b", f"{n - 1} more hits parked behind X1's stream", error=Hang)
    finally:
        b.gate.unlink(missing_ok=True)
    for t in threads:
        t.join(REQUEST_TIMEOUT + 30)
    for i in range(n):
        g = out.get(i)
        if not isinstance(g, Generation):
            raise Hang(f"burst of {n} ({policy}): X{i + 1} not answered: {g!r}\n{s.log_tail(120)}")
    return [out[i] for i in range(n)]


# every policy at TP=1 and at TP=2 (issue 24: all three; `best_effort` stops X1's stream at
# its first admission poll on both ranks alike, and every request recomputes what it lacks)
CASES = [pytest.param(tp, p, id=f"tp{tp}-{p}") for tp in (1, 2) for p in POLICIES]


@pytest.mark.parametrize(("burst", "policy"), CASES, indirect=["burst"])
def test_burst_on_one_l3_prefix(burst: Burst, policy: str) -> None:
    ref = burst.reference()
    streamed = policy != "best_effort"  # best_effort stops a stream at its first admission poll
    store = burst.store(policy)
    cfg = burst.config(store, policy)
    log = burst.root / f"l3-{policy}.log"
    with Server(cfg, log, startup_timeout=STARTUP_TIMEOUT) as s:
        with bounded(TEST_BOUND * 2, f"bursts at TP={burst.tp}, {policy}", lambda: [s]):
            burst.write_prefix(s, store)
            for n in BURSTS:
                mark = len(s.log_text())
                got = run_burst(burst, s, n, policy, streamed=streamed)
                text = s.log_text()[mark:]
                for i, g in enumerate(got):
                    same_output(g, ref[n][i], f"X{i + 1} of a burst of {n} (TP={burst.tp}, {policy}) vs no-cache")
                if streamed:
                    assert got[0].cached_storage == len(PREFIX), (got[0].meta, "X1 restores the prefix")
                    for i, g in enumerate(got[1:], 2):
                        assert g.cached_device >= len(PREFIX) and g.cached_storage == 0, (i, g.meta)
                    # one stream per burst: the others share it (the line is logged by every rank)
                    assert len(set(STREAM_START.findall(text))) == 1, text[-4000:]
                    assert "streamed restore truncated" not in text
                    assert re.search(r"streamed restore req=\S+ waits for req=", text)
                else:
                    # a stream that started stops at the same piece on every rank (one decision)
                    started = STREAM_START.findall(text)
                    stops = Counter(STOP_BEST_EFFORT.findall(text))
                    assert {rid for rid, _ in stops} <= set(started), text[-4000:]
                    assert all(k == burst.tp for k in stops.values()), stops
                assert WATCHDOG not in text, s.log_tail(80)
                assert VERIFY_FAIL not in text
        assert s.alive()


@pytest.mark.parametrize("burst", (2,), ids=("tp2",), indirect=True)
def test_tp2_watchdog_ends_the_hang(burst: Burst) -> None:
    """Negative control and watchdog: without stream-share, and with hits cut instead of
    waiting for rows (test fault cut-not-wait), the burst of two hangs; with
    SGLANG_L3_VERIFY=1 the watchdog abandons the stuck wait after the budget + a 5 s margin
    on both ranks in the same pass, and every answer is still the no-cache server's."""
    ref = burst.reference()
    # the hang needs a cut second stream: with a hit that waits for rows there is none
    fault = f"stream-hold@{burst.gate},cut-not-wait"
    env = {"SGLANG_L3_DISABLE": "stream-share", "SGLANG_L3_WAIT_MARGIN": "5", "SGLANG_L3_TEST_FAULT": fault}
    store = burst.store("watchdog")
    cfg = burst.config(store, "wait_complete", env)
    with Server(cfg, burst.root / "watchdog.log", startup_timeout=STARTUP_TIMEOUT) as s:
        with bounded(TEST_BOUND * 2, "watchdog at TP=2", lambda: [s]):
            burst.write_prefix(s, store)
            mark = len(s.log_text())
            got = run_burst(burst, s, 2, "wait_complete")
        text = s.log_text()[mark:]
        for i, g in enumerate(got):
            same_output(g, ref[2][i], f"X{i + 1} after the watchdog (TP=2) vs no-cache")
        assert "streamed restore truncated" in text, "the hang's precondition did not occur"
        lines = [ln for ln in text.splitlines() if WATCHDOG in ln]
        assert lines, f"the watchdog did not fire\n{s.log_tail(80)}"
        # one decision, taken by both ranks in the same pass, each line naming both ranks' state
        assert all("TP rank 0:" in ln and "TP rank 1:" in ln for ln in lines), lines
        rids = [re.search(r"req=(\S+)", ln).group(1) for ln in lines]
        assert len(rids) == 2 and len(set(rids)) == 1, lines
        assert VERIFY_FAIL not in text


# --------------------------------------------------------------------------- #
# Issue 48: an abort at any point of a streamed restore, through the real server
# --------------------------------------------------------------------------- #
PIECE_PAGES = 2  # 0.4 of the 384-token host pool, page-floored: 128 tokens
STREAM_PIECES = (len(PREFIX) // PAGE_SIZE - 1) // PIECE_PAGES  # R: every piece but the final round's
WAITING_TIMEOUT_S = 20  # SGLANG_REQ_WAITING_TIMEOUT of the TP=2 server (its timeout case)
ABORTED = re.compile(r"streamed restore aborted req=(\S+) reason=aborted landed=(\d+)/(\d+)")
LEAK = "memory leak detected"
# (how, k): abort once k of the stream's pieces landed and the reads of the next ones are
# held in flight (test fault read-hold); how: /abort_request, a client that disconnects,
# or upstream's waiting-queue timeout (SGLANG_REQ_WAITING_TIMEOUT)
ABORTS = {
    1: [("abort_request", 0), ("abort_request", 1), ("abort_request", STREAM_PIECES - 1), ("disconnect", 2)],
    2: [
        ("abort_request", 0),
        ("abort_request", 2),
        ("abort_request", STREAM_PIECES - 1),
        ("disconnect", 1),
        ("timeout", 2),
    ],
}


def _disconnecting_client(s: Server, ids: list[int], rid: str) -> Any:
    """A streamed /generate whose client goes away (the socket closed) when told."""
    import http.client

    conn = http.client.HTTPConnection(s.base.split("//", 1)[1], timeout=REQUEST_TIMEOUT)
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW},
        "stream": True,
        "rid": rid,
    }
    conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn


@pytest.mark.parametrize(
    ("burst", "core"),
    [pytest.param(1, "python", id="tp1-python"), pytest.param(2, "rust", id="tp2-rust")],
    indirect=["burst"],
)
def test_abort_mid_restore_keeps_the_server(burst: Burst, core: str) -> None:
    """Issue 48: a request whose 2,176-token prefix streams back from L3 is aborted after
    k of its 16 pieces landed, with the next reads in flight, by /abort_request, by its
    client disconnecting and (TP=2) by upstream's waiting-queue timeout, with upstream's
    strict idle leak check on (its default). Before the fix the scheduler went idle while
    the aborted stream still held its rows and exited on `pool memory leak detected`.
    After each abort the server stays up and, while the aborted stream's reads still
    hang, answers a new prompt that needs more rows than the pool has beside the stream's
    (its device rows are back at once; before 2026-12-07 that prompt waited for the hung
    reads); then it flushes; at the end the same request is answered as the no-cache
    server answers it, its prefix restored from L3."""
    ref = burst.reference()
    store = burst.store(f"abort-{core}")
    read_gate = burst.root / f"read-hold-{core}.gate"
    env = {
        "SGLANG_L3_TEST_FAULT": f"stream-hold@{burst.gate},read-hold@{read_gate}",
        "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": core,
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",  # upstream's default, stated
    }
    if burst.tp == 2:
        env["SGLANG_REQ_WAITING_TIMEOUT"] = str(WAITING_TIMEOUT_S)
    cfg = burst.config(store, "wait_complete", env)
    x = BURSTS[2][0]
    with Server(cfg, burst.root / f"abort-{core}.log", startup_timeout=STARTUP_TIMEOUT) as s:
        with bounded(TEST_BOUND * 2, f"aborts mid-restore at TP={burst.tp}", lambda: [s]):
            burst.write_prefix(s, store)
            for j, (how, k) in enumerate(ABORTS[burst.tp]):
                what = f"{how} after {k} of {STREAM_PIECES} pieces (TP={burst.tp}, {core})"
                flush(s, f"flush before {what}")
                rid = f"abort-{how}-{k}"
                read_gate.write_text(str(k))
                mark = len(s.log_text())
                client = None
                if how == "disconnect":
                    client = _disconnecting_client(s, x, rid)
                else:
                    _send_aborted(s, x, rid)
                # piece k's read is held: the pieces before it were read (and land as copies)
                wait_log(
                    s, mark, rf"read-hold: piece {k} of a streamed restore waits", f"{what}: reads held", error=Hang
                )
                time.sleep(1.0)  # the pieces read before the hold land meanwhile (not asserted on)
                if how == "abort_request":
                    s.abort(rid)
                elif client is not None:
                    client.close()
                wait_log(
                    s, mark, rf"streamed restore aborted req={rid} reason=aborted", f"{what}: the abort", error=Hang
                )
                # the scheduler now has no request: upstream's idle check runs while the
                # aborted stream's reads are still held in flight
                time.sleep(2.0)
                assert s.alive() and LEAK not in s.log_text()[mark:], f"{what}: the server died\n{s.log_tail(80)}"
                # The reads still hang, yet the aborted stream's device rows are back: a prompt
                # needing more than the rest of the pool is answered now (before 2026-12-07 it
                # waited until the reads returned: a hung store held the pool).
                try:
                    fresh = s.generate(FRESH[j], NEW, timeout=FRESH_TIMEOUT_S)
                except (TimeoutError, OSError) as e:
                    raise AssertionError(f"{what}: a new prompt waited on the hung reads: {e}") from e
                assert fresh.cached_storage == 0, fresh.meta
                same_output(fresh, burst.fresh_ref[j], f"{what}: the new prompt vs no-cache")
                read_gate.unlink()
                flush(s, f"flush after {what}")  # refused until the stream has freed its rows
                text = s.log_text()[mark:]
                assert s.alive() and LEAK not in text, f"{what}: the server died\n{s.log_tail(80)}"
                landed = [int(m[1]) for m in ABORTED.findall(text) if m[0] == rid]
                assert len(landed) == burst.tp, (what, landed)  # one line per rank, the same point
                assert len(set(landed)) == 1 and landed[0] <= k * PIECE_PAGES, (what, landed)
            g = generate(s, x, NEW, "the request after the aborts")
            same_output(g, ref[2][0], f"X1 after the aborts (TP={burst.tp}, {core}) vs no-cache")
            assert g.cached_storage == len(PREFIX), (g.meta, "the prefix restored from L3")
        assert s.alive() and LEAK not in s.log_text()


def _send_aborted(s: Server, ids: list[int], rid: str) -> None:
    """A request the test aborts: its answer (an abort, or an error) is not looked at."""

    def run() -> None:
        with contextlib.suppress(Exception):
            s.generate(ids, NEW, timeout=REQUEST_TIMEOUT, rid=rid)

    threading.Thread(target=run, name=rid, daemon=True).start()
