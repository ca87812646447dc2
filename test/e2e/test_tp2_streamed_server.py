"""Issue 11 at TP=2 (the user's topology) through real servers on CPU: a context
>= 4x the host staging buffer is written to L3 window by window and, after
`/flush_cache`, comes back from L3 in rounds through that buffer on both ranks
(piece completion and the stream's start decision MIN-reduced across the ranks;
SGLANG_L3_VERIFY=1 all-gathers every restore decision and compares them).

For each model family (tiny Qwen3-Next; tiny Qwen3.5 text-only, whose Gated-DeltaNet
input takes the contiguous split): two TP=2 servers, one after the other (two do
not fit two shared cores): a reference without any cache (and without overlap
scheduling), then a buffer-only L3 server (overlap scheduling on) whose host buffer
(`--hicache-ratio`) is < 1/4 of the prompt. The restored answer must match the
reference's tokens and logprobs (TP=2 vs TP=2: `--load-format dummy` makes TP=1
and TP=2 different models). Without `streamed-restore` the same run restores 0
(the hit is declined: test/integration/test_streamed_restore.py's control).

Issue 50 item 3, on the same servers: a prefix that fits the host buffer but spans more
than one regular piece (restorable 320 tokens, a ~384-token buffer, 128-token pieces)
comes back from L3 after `/flush_cache` in rounds too (five 64-token pieces) (patch `stream-fitting-hits`): the no-cache
answer, and each rank's `l3_stream_restore{fitting}` counts it.

A "speaks next" hint beside other agents' greedy requests, on the same L3 server: agents
share a system prompt; after `/flush_cache` each agent's request is sent right after a hint
(`POST /sglang_l3/prefetch`) that stages another agent's context from L3, so the hint's
prefill-only request and the agent's request share batches. Every answer equals the no-cache
server's. Before the hint's sampling parameters were greedy (sessions/hints.py
HINT_SAMPLING_PARAMS), a hint took the running batch off upstream's greedy sampling path for
the rest of its life, and greedy requests broke exact logit ties by sorting (`--load-format
dummy` at TP=2 ties token t with t + vocab/2): other agents' tokens changed.

A prompt within a page of the device pool (prompt + the per-request page = the pool), on
the same L3 server, last: both ranks refuse it at arrival with an error the client sees
(HTTP 400), and the server answers the next request as the no-cache one does. Without
patch `prompt-fits-pool` it is queued for ever and every request behind it waits.

Issue 24 item 5, on the same L3 server: one rank's page past a stored checkpoint is
damaged between rounds (the prompt is prefilled in 256-token chunks, so L3 holds a
Mamba checkpoint every 256 tokens). Both ranks restore up to the deepest checkpoint
below the damage — a KV page inside the streamed rounds (the stream is cut, keeping
what landed), the last checkpoint's state (upstream's final round, re-queried), found
by the read (flip) or by the hit query (truncate) — with the no-cache answer, and the
damaged page is rewritten by the recompute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from l3_e2e import (
    CHUNKED_PREFILL,
    PAGE_SIZE,
    PREFETCH_THRESHOLD,
    STARTUP_TIMEOUT,
    family_params,
    published_counters,
    restorable,
    settled_counters,
)
from sglang_l3.testing.server import Generation, Server, ServerConfig, prompt
from tp2_e2e import (
    DEVICE,
    REQUEST_TIMEOUT,
    TEST_BOUND,
    TP,
    bounded,
    damage,
    flush,
    generate,
    page_file,
    page_keys,
    quarantined,
    same_output,
    wait_for,
)

# two TP=2 servers per family: minutes on CPU
pytestmark = [pytest.mark.e2e, pytest.mark.slow, family_params("qwen3next", "qwen35-text")]

POOL = 4096
HICACHE_RATIO = 0.09  # host KV pool ~ 0.09 x 4096 = 384 tokens (page-rounded)
NEW = 16
IDS = prompt(500, 1800)
FIT_IDS = prompt(501, 330)  # restorable 320: fits the host buffer, > one piece (stream-fitting-hits)
# prompt + a page = the pool: no empty pool admits it (patch prompt-fits-pool refuses it)
UNFIT_IDS = prompt(502, POOL - PAGE_SIZE)
AFTER_IDS = prompt(503, 200)  # served after the refusal
# agents sharing a 2-page system prompt: the hinted contexts and the requests beside them
SYSTEM_IDS = prompt(504, 2 * PAGE_SIZE)
HINTED_IDS = [SYSTEM_IDS + prompt(510 + i, 80) for i in range(3)]
BESIDE_IDS = [SYSTEM_IDS + prompt(520 + i, 57) for i in range(3)]
HINT_ROUNDS = 2
VERIFY_FAIL = "TP ranks made different L3 restore decisions"


def _config(store: Path | None, model: str) -> ServerConfig:
    return ServerConfig(
        model=model,
        storage_dir=str(store) if store else None,
        device=DEVICE,
        tp_size=TP,
        max_total_tokens=POOL,
        chunked_prefill_size=CHUNKED_PREFILL,
        page_size=PAGE_SIZE,
        prefetch_threshold=PREFETCH_THRESHOLD if store else None,
        # the user's default `timeout` stop policy, with a budget a loaded 2-core box cannot miss
        storage_extra_config={"prefetch_timeout_base": 600} if store else {},
        extra_args=["--hicache-ratio", str(HICACHE_RATIO)] if store else [],
        env={"SGLANG_L3_VERIFY": "1"}
        | ({"SGLANG_L3_PUBLISH_STATS": "1", "SGLANG_L3_STATS_DIR": str(store.parent / "stats")} if store else {}),
        overlap_schedule=store is not None,  # the no-cache reference schedules without overlap
    )


@dataclass
class Run:
    store: Path
    server: Server | None = None
    want: Generation | None = None
    want_fit: Generation | None = None
    want_after: Generation | None = None
    want_beside: list[Generation] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, family: str, hash_extension_built):
    from sglang_l3.cpu import accelerator_present

    if DEVICE == "cpu" and accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    if DEVICE != "cpu":
        import torch

        if torch.cuda.device_count() < TP:
            pytest.skip(f"TP={TP} on {DEVICE} needs {TP} GPUs, found {torch.cuda.device_count()}")
    root = tmp_path_factory.mktemp(f"e2e-tp2-streamed-{family}")
    r = Run(store=root / "store")
    with Server(_config(None, family), root / "plain.log", startup_timeout=STARTUP_TIMEOUT) as ref:
        r.servers.append(ref)
        with bounded(TEST_BOUND, "reference", lambda: r.servers):
            r.want = generate(ref, IDS, NEW, "reference")
            r.want_fit = generate(ref, FIT_IDS, NEW, "reference (fitting prefix)")
            r.want_after = generate(ref, AFTER_IDS, NEW, "reference (after a refusal)")
            r.want_beside = [
                generate(ref, ids, NEW, f"reference (beside a hint) {i}") for i, ids in enumerate(BESIDE_IDS)
            ]
        r.servers.clear()
    assert len(set(r.want.output_ids)) > 1, "degenerate dummy weights"
    r.server = Server(_config(r.store, family), root / "l3.log", startup_timeout=STARTUP_TIMEOUT).start()
    r.servers.append(r.server)
    try:
        yield r
    finally:
        r.server.stop()


def test_tp2_context_4x_host_buffer_restores_from_l3(run: Run) -> None:
    s = run.server
    m = re.search(r"HiCache kv host pool \((\d+) tokens\)", s.log_text())
    assert m, "host pool size not logged"
    host = int(m.group(1))
    assert len(IDS) >= 4 * host, f"context {len(IDS)} must be >= 4x the host buffer {host}"
    with bounded(TEST_BOUND, "streamed restore at TP=2", lambda: run.servers):
        cold = generate(s, IDS, NEW, "cold")
        assert cold.cached_tokens == 0, cold.meta
        same_output(cold, run.want, "cold vs no-cache TP=2")
        flush(s, "flush after the cold run")
        warm = generate(s, IDS, NEW, "after flush")
    assert warm.cached_device == 0 and warm.cached_host == 0, warm.meta
    assert warm.cached_storage == restorable(len(IDS)), (warm.meta, len(IDS))
    same_output(warm, run.want, f"{len(IDS)}-token prompt from L3 through a {host}-token buffer at TP=2")
    log = s.log_text()
    assert VERIFY_FAIL not in log, s.log_tail(80)
    assert "bounce cannot fit in an empty host arena" not in log


def test_tp2_prefix_that_fits_the_host_buffer_streams_too(run: Run) -> None:
    from sglang_l3.patches.hicache.streamed_restore import DEFAULT_PIECE_FRACTION

    s = run.server
    m = re.search(r"HiCache kv host pool \((\d+) tokens\)", s.log_text())
    assert m, "host pool size not logged"
    host = int(m.group(1))
    piece = int(host * DEFAULT_PIECE_FRACTION) // PAGE_SIZE * PAGE_SIZE
    hit = restorable(len(FIT_IDS))
    assert piece < hit <= host, f"the prefix ({hit}) must fit the host buffer ({host}) and exceed a piece ({piece})"
    stats = run.store.parent / "stats"
    with bounded(TEST_BOUND, "fitting prefix at TP=2", lambda: run.servers):
        cold = generate(s, FIT_IDS, NEW, "cold (fitting prefix)")
        assert cold.cached_tokens == 0, cold.meta
        same_output(cold, run.want_fit, "cold fitting prefix vs no-cache TP=2")
        flush(s, "flush after the cold fitting run")
        before = settled_counters(stats)
        warm = generate(s, FIT_IDS, NEW, "fitting prefix after flush")
        assert warm.cached_device == 0 and warm.cached_host == 0, warm.meta
        assert warm.cached_storage == hit, (warm.meta, hit)
        same_output(
            warm, run.want_fit, f"{len(FIT_IDS)}-token prompt from L3, {hit} tokens through a {host}-token buffer"
        )

        def grown(label: str) -> float:
            key = f"l3_stream_restore{{{label}}}"
            return published_counters(stats).get(key, 0) - before.get(key, 0)

        # each rank streams it (one stream per rank), then admits it
        wait_for(lambda: all(grown(k) >= TP for k in ("started", "fitting", "restored")), 60, "the fitting streams")
    # on failure: what grew, and each rank's stream log lines (starts, waits, aborts)
    streams = [line for line in s.log_text().splitlines() if "streamed restore" in line]
    assert all(grown(k) == TP for k in ("started", "fitting", "restored")), (
        {k: grown(k) for k in ("started", "fitting", "restored", "final_waited", "aborted")},
        streams[-16:],
    )
    assert VERIFY_FAIL not in s.log_text(), s.log_tail(80)


LAST = restorable(len(IDS)) // PAGE_SIZE  # pages of the deepest checkpoint (1792 tokens)
# (mode, target, rank, restored): KV page 17 (tokens 1088-1152, the page) lies in
# the streamed rounds, past the checkpoint at 1024; "mamba" = the 1792-token checkpoint's
# state, past the one at 1536. Found by the read (flip) or by the hit query (truncate).
STREAMED_DAMAGE = [
    ("flip", 17, 1, 1024),
    ("flip", "mamba", 1, 1536),
    ("truncate", 17, 0, 1024),
    ("truncate", "mamba", 0, 1536),
]


@pytest.mark.parametrize(
    "mode,target,rank,expect", STREAMED_DAMAGE, ids=[f"{m}-{t}-r{r}" for m, t, r, _ in STREAMED_DAMAGE]
)
def test_tp2_streamed_damage_restores_up_to_the_checkpoint_below(
    run: Run, mode: str, target: int | str, rank: int, expect: int
) -> None:
    s = run.server
    keys = page_keys(IDS)
    pool, key = ("mamba", keys[LAST - 1]) if target == "mamba" else ("kv", keys[int(target)])
    with bounded(TEST_BOUND, f"{mode} of rank {rank}'s {pool} page at TP=2", lambda: run.servers):
        victim = page_file(run.store, key, pool, rank)
        if victim is None:
            pytest.fail(f"rank {rank}'s {pool} page {key[:12]} is not in the store (an earlier round did not heal?)")
        other = page_file(run.store, key, pool, 1 - rank)
        assert other is not None
        q_before = set(quarantined(run.store))
        flush(s, "flush before damage")
        damage(victim, mode)
        got = generate(s, IDS, NEW, f"after {mode} of rank {rank}'s {pool} page")
        same_output(got, run.want, f"after {mode} of rank {rank}'s {pool} page")
        assert got.cached_device == 0, got.meta
        assert got.cached_storage == expect, (got.meta, expect)
        assert VERIFY_FAIL not in s.log_text(), s.log_tail(80)
        new_q = set(quarantined(run.store)) - q_before
        assert any(victim.name in q for q in new_q), (victim.name, new_q)
        assert not any(other.name in q for q in new_q), f"the other rank's page was quarantined: {new_q}"
        # the recompute rewrote the damaged page: the next round starts from a whole store
        wait_for(lambda: page_file(run.store, key, pool, rank) is not None, 120, "damaged page rewritten")


def test_tp2_a_hint_beside_greedy_requests_changes_none_of_their_tokens(run: Run) -> None:
    s = run.server
    with bounded(TEST_BOUND, "hints beside greedy requests at TP=2", lambda: run.servers):
        for i, ids in enumerate(HINTED_IDS):
            generate(s, ids, NEW, f"hinted context {i}")
        for rnd in range(HINT_ROUNDS):
            flush(s, f"flush before round {rnd}")  # the contexts come back from L3
            for i, ids in enumerate(BESIDE_IDS):
                other = HINTED_IDS[(i + rnd + 1) % len(HINTED_IDS)]
                status, out = s.post("/sglang_l3/prefetch", {"input_ids": other}, timeout=REQUEST_TIMEOUT)
                assert status == 200 and "hint_id" in out, (status, out)
                got = generate(s, ids, NEW, f"round {rnd} request {i} beside a hint")
                same_output(got, run.want_beside[i], f"round {rnd} request {i} beside a hint")
    assert VERIFY_FAIL not in s.log_text(), s.log_tail(80)


def test_tp2_a_prompt_no_empty_pool_admits_is_refused_and_the_server_serves_on(run: Run) -> None:
    s = run.server
    with bounded(TEST_BOUND, "a prompt within a page of the pool at TP=2", lambda: run.servers):
        body = {"input_ids": UNFIT_IDS, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}
        status, answer = s.post("/generate", body, timeout=REQUEST_TIMEOUT)
        assert status == 400, (status, str(answer)[:500], s.log_tail(40))
        assert "exceeds the KV memory budget" in str(answer), answer
        assert "prompt-fits-pool" in s.log_text()
        got = generate(s, AFTER_IDS, NEW, "the request after the refusal")
        same_output(got, run.want_after, "after the refusal")
        assert VERIFY_FAIL not in s.log_text(), s.log_tail(80)
