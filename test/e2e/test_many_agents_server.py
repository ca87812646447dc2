"""Sixteen plain agents through one buffer-only L3 server (issue 32, item 3; the
smoke size of `benchmark/agents.py --agents 16`).

Tiny Qwen3.5; no session_id, no hints. The device pool holds one agent's
longest turn and the host buffer one page, so the agents' contexts together are
more than 10x what device and host hold; 3 rounds, later ones in a seeded
shuffled order. Every answer (tokens, logprobs) equals the no-cache server's,
every returning agent's context comes back from L3 (the server's own
cached_tokens_details: nothing from the device, its last prompt from storage
up to the last chunk boundary, where the Mamba state was checkpointed: a context
whose write is still queued stays on the device until it staged, patch write-guard),
the store stays within its byte cap, and afterwards no
device KV token is held outside the free list and the tree (GET /v1/loads) and
upstream's strict idle leak check (KV, Mamba, request slots) never fired.
"""

from __future__ import annotations

import re

import pytest
from l3_e2e import STARTUP_TIMEOUT, assert_same_output, family_params, reference_scenario
from sglang_l3.testing import many_agents
from sglang_l3.testing.server import Server

pytestmark = [pytest.mark.e2e, family_params("qwen35")]

WL = many_agents.Workload(agents=16, rounds=3, context=352, message=16, new=4, seed=0)
HOST_RATIO = 0.01  # the host buffer upstream makes of it: one page (ratio x pool + one page, whole pages)
_EVICTED = re.compile(
    r"L3 write dropped: node (\S+) \((\d+) tokens\) was evicted from the device before its write staged"
)
CAP = 32 * 2**20  # the store's byte cap; the agents' pages take about a third of it (about 11 MiB)


@reference_scenario(families=("qwen35",))
def _no_cache(server) -> list[many_agents.Turn]:
    return many_agents.run(server, WL)


def test_sixteen_plain_agents_return_from_l3(tmp_path, cluster, reference):
    if cluster.device != "cpu":
        pytest.skip("the CPU smoke size")
    want = many_agents.run(reference, WL)
    reference.stop()  # one server at a time
    store = tmp_path / "store"
    cfg = many_agents.l3_config(
        WL,
        store,
        model=cluster.model,
        host_ratio=HOST_RATIO,
        cap_bytes=CAP,
        # upstream's prefetch deadline (1 s + 0.25 s per 1K tokens) can expire on a loaded
        # 2-core box and the turn recomputes: a budget it cannot miss (a hang is not a deadline)
        extra={"prefetch_timeout_base": 600},
    )
    with Server(cfg, tmp_path / "l3.log", startup_timeout=STARTUP_TIMEOUT) as s:
        host = many_agents.host_tokens(s)
        over = WL.oversubscription(WL.pool(), host)
        assert over >= 10, f"contexts only {over:.1f}x device ({WL.pool()}) + host ({host})"
        got = many_agents.run(s, WL)
        missed = []
        for g, w in zip(got, want, strict=True):
            what = f"round {g.round + 1} agent {g.agent}"
            assert g.ids == w.ids, what
            assert len(w.gen.output_ids) == WL.new, (what, w.gen.meta)  # a real answer to compare
            assert_same_output(g.gen, w.gen, "cpu", what)
            if g.round == 0:
                assert g.gen.cached_tokens == 0, (what, g.gen.meta)
                continue
            # 15 other agents spoke since: nothing of this one is left on the device; its
            # previous prompt comes back from L3 up to its last Mamba checkpoint, which a
            # chunked prefill (256) leaves at a chunk boundary (368 tokens -> 256 restored)
            assert g.gen.cached_device == 0 and g.gen.cached_host == 0, (what, g.gen.source)
            if g.gen.cached_storage < g.previous // 256 * 256:
                missed.append((what, g.previous, g.gen.source))
        # A context whose write was still queued when the next agent's prefill or restore
        # wanted its rows stays on the device until the write staged (patch write-guard);
        # a miss names what the server logged: sweeps, the guard's valve, declines, cuts.
        log = s.log_text()
        swept = sorted({(n, int(t)) for n, t in _EVICTED.findall(log)})
        why = re.findall(r"(?:streamed restore (?:declined|truncated)|L3 write guard released) .*", log)
        assert not missed, (missed, "swept:", swept, why)
        assert s.alive(), "server died (upstream's strict idle leak check?)"
        assert many_agents.pool_in_use(s) == 0, "device KV held outside the free list and the tree"
        used = many_agents.store_bytes(store)
        assert 0 < used <= CAP, (used, CAP)
