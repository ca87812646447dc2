"""The whole buffer-only L3 restore of a Gated-DeltaNet hybrid, through a real server,
for each model family (tiny Qwen3-Next, tiny Qwen3.5 multimodal).

In file order (the servers are shared): on the first server (large device
pool) P -> /flush_cache -> P, a prompt longer than --chunked-prefill-size, and
two interleaved agents for reference; then a restarted server over the same
store (small device pool): P again, and the two agents, every turn of which
must come back from L3 with the large pool's output. Every answer (computed or
restored) equals the family's no-cache server (`cluster.expected`). A restart
test run alone computes its first-server reference itself (Cluster.reference),
never skips.

The reanchor and stale-cow defects cannot be provoked through HTTP (upstream's
caller rebinds the request right after init_load_back; the stale-CoW window needs
evictions placed between two admission passes), so their negative controls run
in-process: test/integration/test_reanchor.py and test_stale_cow.py.
"""

from __future__ import annotations

import pytest
from l3_e2e import (
    LONG,
    LONG_LEN,
    NEW_TOKENS,
    P_LEN,
    P,
    assert_same_output,
    family_params,
    reference_scenario,
    restorable,
    run_agents,
)
from sglang_l3.testing.server import Generation, prompt

pytestmark = [pytest.mark.e2e, family_params("qwen3next", "qwen35")]

# A context that leaves another mid-node (two agents with one system prompt; patch
# mamba-prefill-cuts): BRANCH_A is prefilled in two chunks (Mamba states at 256 and at its
# end, 384); BRANCH_B shares its first 330 tokens, so B's match finds KV up to 320 and the
# last state before it at 256, and 320 is B's branching point.
BRANCH_A = prompt(3, 400)
BRANCH_B = BRANCH_A[:330] + prompt(4, 100)


def branch_turns(server) -> list[Generation]:
    """A, then B, then B's next call (its history + a new message)."""
    a = server.generate(BRANCH_A, NEW_TOKENS)
    b = server.generate(BRANCH_B, NEW_TOKENS)
    b2 = server.generate(BRANCH_B + b.output_ids + prompt(5, 48), NEW_TOKENS)
    return [a, b, b2]


# Prompts that end on the Mamba grid (64), each followed by a call that shares all but its
# last token, as a chat template's next call does (patch mamba-prefill-cuts): TAIL_A's last
# chunk continues a chunked prefill (256-token chunks), TAIL_C's one extend follows a
# device hit (960 of its 1,152 tokens).
TAIL_A = prompt(6, 1024)
TAIL_C = TAIL_A[:-1] + prompt(7, 129)


def tail_turns(server) -> list[Generation]:
    """TAIL_A, its next call, TAIL_C, its next call."""
    a = server.generate(TAIL_A, NEW_TOKENS)
    a2 = server.generate(TAIL_A[:-1] + prompt(8, 50), NEW_TOKENS)
    c = server.generate(TAIL_C, NEW_TOKENS)
    c2 = server.generate(TAIL_C[:-1] + prompt(9, 50), NEW_TOKENS)
    return [a, a2, c, c2]


@reference_scenario
def _no_cache_answers(server) -> None:
    server.generate(P, NEW_TOKENS)
    server.generate(LONG, NEW_TOKENS)
    run_agents(server)
    branch_turns(server)
    tail_turns(server)


@pytest.fixture(scope="module", autouse=True)
def _close_clusters_after(clusters):
    """pytest runs one family's tests of every module before the next family's:
    leaving this module means its family's cluster servers are done."""
    yield
    for c in clusters.values():
        c.close()


def test_flush_then_same_prompt_restores_from_l3(cluster):
    s = cluster.first()
    cold = s.generate(P, NEW_TOKENS)
    assert cold.cached_tokens == 0, cold.meta
    assert_same_output(cold, cluster.expected.generate(P), cluster.device, "P computed vs no-cache")
    s.flush_cache()  # drops the device tree (buffer-only: no host copy either)
    warm = s.generate(P, NEW_TOKENS)
    assert warm.cached_device == 0 and warm.cached_host == 0, warm.meta
    assert warm.cached_storage == restorable(P_LEN), warm.meta
    assert warm.cached_tokens == warm.cached_storage
    assert_same_output(warm, cold, cluster.device, "P after /flush_cache")
    assert len(set(cold.output_ids)) > 1, "degenerate dummy weights (one repeated token)"
    cluster.results["P"] = cold


def test_prompt_longer_than_chunked_prefill_restores(cluster):
    s = cluster.first()
    cold = s.generate(LONG, NEW_TOKENS)
    assert cold.cached_tokens == 0, cold.meta
    assert_same_output(cold, cluster.expected.generate(LONG), cluster.device, f"{LONG_LEN} tokens vs no-cache")
    s.flush_cache()
    warm = s.generate(LONG, NEW_TOKENS)
    assert warm.cached_device == 0, warm.meta
    assert warm.cached_storage == restorable(LONG_LEN), warm.meta
    assert_same_output(warm, cold, cluster.device, f"{LONG_LEN}-token prompt after /flush_cache")
    cluster.results["ttft"] = {
        "prompt_tokens": LONG_LEN,
        "restored_tokens": warm.cached_storage,
        "ttft_cold_s": cold.ttft_s,
        "ttft_l3_s": warm.ttft_s,
    }


def test_interleaved_agents_reference_on_large_pool(cluster):
    s = cluster.first()
    s.flush_cache()
    turns = run_agents(s)
    # the large pool keeps both agents' histories: later turns reuse the device tree
    for (a, k, g), (_, _, want) in zip(turns, run_agents(cluster.expected), strict=True):
        if k > 0:
            assert g.cached_device > 0 and g.cached_storage == 0, (a, k, g.meta)
        assert_same_output(g, want, cluster.device, f"agent {a} turn {k} vs no-cache")
    cluster.results["agents"] = turns


def test_branch_keeps_its_own_prompt_end(cluster):
    """B's next call resumes at the end of B's prompt (384), not at its branch from A (320):
    upstream tracks B's state at the branch instead of at its prompt's end, and caches a
    finished request only up to its last state."""
    s = cluster.first()
    s.flush_cache()
    turns = branch_turns(s)
    a, b, b2 = turns
    assert a.cached_tokens == 0, a.meta
    assert b.cached_device == 256, b.meta  # A's last state before the branch
    assert b2.cached_device == restorable(len(BRANCH_B)), b2.meta  # B's own end (384), not 320
    for got, want, what in zip(turns, branch_turns(cluster.expected), ("A", "B", "B's next call"), strict=True):
        assert_same_output(got, want, cluster.device, f"{what} vs no-cache")


def test_prompt_on_the_grid_leaves_a_state_for_the_next_call(cluster):
    """A prompt of whole grid steps keeps a state one step before its end: the next call,
    which shares all but the last token, resumes there (960 of TAIL_A's 1,024, 1,088 of
    TAIL_C's 1,152), not a chunk or a turn back."""
    s = cluster.first()
    s.flush_cache()
    turns = tail_turns(s)
    a, a2, c, c2 = turns
    assert a.cached_tokens == 0, a.meta
    assert a2.cached_device == restorable(len(TAIL_A)), a2.meta
    assert c.cached_device == restorable(len(TAIL_A)), c.meta
    assert c2.cached_device == restorable(len(TAIL_C)), c2.meta
    names = ("TAIL_A", "TAIL_A's next call", "TAIL_C", "TAIL_C's next call")
    for got, want, what in zip(turns, tail_turns(cluster.expected), names, strict=True):
        assert_same_output(got, want, cluster.device, f"{what} vs no-cache")


def test_restart_restores_from_l3(cluster):
    before = cluster.reference("P")
    s = cluster.restarted()
    after = s.generate(P, NEW_TOKENS)
    assert after.cached_device == 0, after.meta
    assert after.cached_storage == restorable(P_LEN), after.meta
    assert_same_output(after, before, cluster.device, "P after a server restart")
    assert_same_output(after, cluster.expected.generate(P), cluster.device, "P after a restart vs no-cache")


def test_interleaved_agents_small_pool_restore_every_turn_from_l3(cluster):
    reference = cluster.reference("agents")
    s = cluster.restarted()
    turns = run_agents(s)
    nocache = run_agents(cluster.expected)
    for (a, k, got), (_, _, want), (_, _, plain) in zip(turns, reference, nocache, strict=True):
        # the pool cannot hold the other agent's history: nothing of this agent's
        # prefix is left on the device, all of it comes back from L3
        assert got.cached_device == 0, (a, k, got.meta)
        assert got.cached_storage >= 256, (a, k, got.meta)
        assert_same_output(got, want, cluster.device, f"agent {a} turn {k}")
        assert_same_output(got, plain, cluster.device, f"agent {a} turn {k} vs no-cache")
