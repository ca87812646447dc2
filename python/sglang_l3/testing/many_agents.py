"""Many plain agents taking turns over one server (issue 32, item 3): shared by
benchmark/agents.py (`--agents 16`) and test/e2e/test_many_agents_server.py.

A plain client: no session_id, no hints, nothing but `/generate` with input ids.
Each agent starts with its own context and every turn appends a short user
message to its history and last answer; round 1 goes in agent order, later
rounds in a seeded shuffled order (nobody speaks twice in a row).

The server is sized so that the agents' contexts together are many times what
the device pool and the host buffer hold (`Workload.oversubscription`): a
returning agent's context can only come back from L3.

`pool_in_use` reads upstream's own accounting (GET /v1/loads): tokens held by
neither the free list nor the radix tree; after the run, on an idle server, it
must be 0 (upstream's idle self-check, strict by default, also stops a server
whose KV, Mamba or request-slot pools do not add up).
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from sglang_l3.testing.server import Generation, Server, ServerConfig, prompt

PAGE = 64


@dataclass(frozen=True)
class Workload:
    agents: int = 16
    rounds: int = 3
    context: int = 480  # first-turn context tokens per agent
    message: int = 32  # user message tokens appended per turn
    new: int = 8  # answer tokens per turn
    seed: int = 0

    @property
    def final_prompt(self) -> int:
        """Tokens of an agent's last prompt (its longest)."""
        return self.context + self.rounds * self.message + (self.rounds - 1) * self.new

    def pool(self) -> int:
        """A device pool (whole pages) that holds one agent's longest turn with two
        pages to spare: with a pool of 384 tokens a 272-token prompt came back with
        no output at all (upstream, no HiCache either); 144 tokens of slack served."""
        return -(-(self.final_prompt + self.new) // PAGE) * PAGE + 2 * PAGE

    def order(self) -> list[tuple[int, int]]:
        """(round, agent): round 0 in agent order, then seeded shuffled rounds in
        which nobody speaks twice in a row."""
        rng = random.Random(self.seed)
        out = [(0, a) for a in range(self.agents)]
        for r in range(1, self.rounds):
            rnd = list(range(self.agents))
            rng.shuffle(rnd)
            if rnd[0] == out[-1][1]:
                rnd[0], rnd[-1] = rnd[-1], rnd[0]
            out += [(r, a) for a in rnd]
        return out

    def oversubscription(self, pool: int, host_tokens: int) -> float:
        """The agents' final contexts (last prompt + answer) together / what the
        device pool and the host buffer hold."""
        return self.agents * (self.final_prompt + self.new) / (pool + host_tokens)


@dataclass
class Turn:
    round: int
    agent: int
    ids: list[int]
    gen: Generation
    previous: int  # tokens of this agent's previous prompt (0 on its first turn)


def run(server: Server, wl: Workload, *, flush_each: bool = False) -> list[Turn]:
    """The workload through `server` as a plain client (greedy, logprobs).
    `flush_each`: POST /flush_cache before every turn (a recompute reference)."""
    history = {a: prompt(7000 + a, wl.context) for a in range(wl.agents)}
    previous = {a: 0 for a in range(wl.agents)}
    turns = []
    for r, a in wl.order():
        ids = history[a] + prompt(100_000 * (a + 1) + r, wl.message)
        if flush_each:
            server.flush_cache()
        g = server.generate(ids, wl.new)
        turns.append(Turn(r, a, ids, g, previous[a]))
        previous[a] = len(ids)
        history[a] = ids + g.output_ids
    return turns


def l3_config(
    wl: Workload,
    store: Path,
    *,
    model: str,
    host_ratio: float,
    cap_bytes: int,
    extra: dict[str, object] | None = None,
    **kw: object,
) -> ServerConfig:
    """A buffer-only L3 server whose device pool holds one agent's turn and whose
    host buffer is `host_ratio` x that pool; the store is capped at `cap_bytes`
    (0: no cap); `extra`: more storage settings."""
    return ServerConfig(
        model=model,
        storage_dir=str(store),
        max_total_tokens=wl.pool(),
        chunked_prefill_size=256,
        prefetch_threshold=PAGE,
        page_size=PAGE,
        storage_extra_config={"max_bytes": cap_bytes, "min_free_bytes": 0, **(extra or {})},
        extra_args=["--hicache-ratio", f"{host_ratio:.6f}"],
        **kw,  # type: ignore[arg-type]
    )


def host_tokens(server: Server) -> int:
    """The host KV buffer's size as the server logged it."""
    import re

    m = re.search(r"HiCache kv host pool \((\d+) tokens\)", server.log_text())
    if m is None:
        raise AssertionError(f"host pool size not logged; log {server.log_path}")
    return int(m.group(1))


def pool_in_use(server: Server) -> int:
    """Device KV tokens held by neither the free list nor the radix tree (upstream's
    num_used_tokens at GET /v1/loads; 0 on an idle server that leaked nothing)."""
    loads = json.loads(server.get_text("/v1/loads"))
    ranks = loads.get("loads", loads) if isinstance(loads, dict) else loads
    if isinstance(ranks, dict):
        ranks = [ranks]
    return sum(int(r["num_used_tokens"]) for r in ranks)


def store_bytes(store: Path) -> int:
    pages = store / "pages"
    return sum(f.stat().st_size for f in pages.iterdir()) if pages.is_dir() else 0


def median_ttft(turns: list[Turn]) -> float:
    """Median time to first token of the returning turns (round >= 1), seconds."""
    xs = [t.gen.ttft_s for t in turns if t.round >= 1]
    return statistics.median(xs) if xs else float("nan")
