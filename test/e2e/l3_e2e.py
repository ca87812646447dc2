"""Scenario constants and helpers shared by the e2e tests and their conftest
(a module of its own: `conftest` is an ambiguous name with test/conftest.py)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sglang_l3.testing.server import Generation, Server, prompt

STARTUP_TIMEOUT = float(os.environ.get("SGLANG_L3_E2E_STARTUP_TIMEOUT", "420"))

# Scenario sizes (tokens). Storage lookups need >= PREFETCH_THRESHOLD matching
# tokens; the Mamba state exists at 64-token checkpoints, so a prompt of n
# tokens is restorable up to the last multiple of 64 below n.
PREFETCH_THRESHOLD = 64
PAGE_SIZE = 64  # one L3 file per 64 tokens and pool (page size 1 = one per token: slow)
CHUNKED_PREFILL = 256
P_LEN = 400
LONG_LEN = 1000  # > CHUNKED_PREFILL: prefilled (and checkpointed) in 4 chunks
LARGE_POOL = 4096
SMALL_POOL = 640  # 10 pages: one agent's longest turn (480 tokens, 8 pages) fits, the
#                   other agent keeps at most 2 pages, less than its first checkpoint (256)
NEW_TOKENS = 16

# Model families (conftest `family` fixture): pytest id -> packaged model
# (sglang_l3.testing.server.PACKAGED_MODELS). tiny-qwen35 is the user's architecture
# (Qwen3_5ForConditionalGeneration, Qwen3.5-27B's head ratios); tiny-qwen35-text is
# the text-only Qwen3_5ForCausalLM with the contiguous GDN split (ratio 2).
FAMILIES = {"qwen3next": "tiny-qwen3next", "qwen35": "tiny-qwen35", "qwen35-text": "tiny-qwen35-text"}


def family_params(*ids: str) -> pytest.MarkDecorator:
    """`pytestmark` / decorator: run the tests once per family (session-scoped, so
    pytest groups each family's tests and starts its servers once)."""
    return pytest.mark.parametrize("family", [pytest.param(FAMILIES[i], id=i) for i in ids], indirect=True)


# --------------------------------------------------------------------------- #
# shared scenario pieces
# --------------------------------------------------------------------------- #
P = prompt(1, P_LEN)
LONG = prompt(2, LONG_LEN)


def restorable(n: int) -> int:
    """Tokens of an n-token prompt an L3 restore can cover (last 64-token checkpoint < n)."""
    return (n - 1) // 64 * 64


def run_agents(server: Server, turns: int = 3) -> list[tuple[int, int, Generation]]:
    """Two agents, interleaved turn by turn (A1 B1 A2 B2 ...), each turn =
    its whole history + a new 48-token user message; greedy 12 new tokens."""
    history = {a: prompt(100 + a, 300) for a in (1, 2)}
    out = []
    for k in range(turns):
        for a in (1, 2):
            ids = history[a] + prompt(1000 * a + k, 48)
            g = server.generate(ids, 12)
            out.append((a, k, g))
            history[a] = ids + g.output_ids
    return out


def assert_same_output(got: Generation, want: Generation, device: str, what: str) -> None:
    assert got.output_ids == want.output_ids, f"{what}: tokens differ"
    if device == "cpu":
        # torch kernels, fp32 chunk states: a restore continues bit-for-bit
        assert not (d := got.logprob_difference(want)), f"{what}: logprobs differ: {d}"
    else:
        # upstream's FLA kernel keeps chunk states in bf16 (k.dtype): close, not exact
        diff = max((abs(x - y) for x, y in zip(got.logprobs, want.logprobs, strict=True)), default=0.0)
        assert diff < 0.1, f"{what}: logprobs differ by {diff}"


# --------------------------------------------------------------------------- #
# no-cache reference scenarios (conftest Reference)
# --------------------------------------------------------------------------- #
REFERENCE_SCENARIOS: list[tuple[Callable[[Any], object], tuple[str, ...] | None]] = []


def reference_scenario(fn: Callable[[Any], object] | None = None, *, families: tuple[str, ...] | None = None) -> Any:
    """Register `fn(server)` (anything with `generate(ids, n)`): the no-cache server
    of each family (FAMILIES ids; all when None) answers it on its first start,
    with all the others, in one go. `@reference_scenario` or
    `@reference_scenario(families=("qwen3next",))`."""

    def register(f: Callable[[Any], object]) -> Callable[[Any], object]:
        models = None if families is None else tuple(FAMILIES[i] for i in families)
        REFERENCE_SCENARIOS.append((f, models))
        return f

    return register if fn is None else register(fn)


def published_counters(stats: Path) -> dict[str, float]:
    """The counters the server's processes published (SGLANG_L3_PUBLISH_STATS=1 into
    SGLANG_L3_STATS_DIR=`stats`), summed over them (both TP ranks count a restore)."""
    out: dict[str, float] = {}
    for f in stats.glob("*.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # being replaced
        for k, v in data.get("counters", {}).items():
            out[k] = out.get(k, 0) + v
    return out


def settled_counters(stats: Path, quiet_s: float = 3.0, timeout: float = 60.0) -> dict[str, float]:
    """`published_counters` once they have not changed for `quiet_s` (a process publishes
    up to 1 s after its last increment, later on a loaded box): a baseline for deltas,
    taken right after a request, must hold that request's last counts. Where they never
    settle within `timeout` (something counts while idle), the last read."""
    last = published_counters(stats)
    since = time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = published_counters(stats)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def wait_log(
    s: Server, mark: int, pattern: str, what: str, seconds: float = 180.0, error: type[Exception] = AssertionError
) -> None:
    """Until the server's log after offset `mark` has a line matching `pattern`; raises
    `error` (with the log's tail) when the server exits or `seconds` pass first."""
    deadline = time.monotonic() + seconds
    while not re.search(pattern, s.log_text()[mark:]):
        if not s.alive() or time.monotonic() > deadline:
            raise error(f"{what}: no log line /{pattern}/ within {seconds:.0f} s\n{s.log_tail(80)}")
        time.sleep(0.1)


def wait_hint(s: Server, hint_id: str, timeout: float = 600.0) -> dict[str, Any]:
    """A "speaks next" hint's state (GET /sglang_l3/prefetch/<id>) once it is no longer
    staging; AssertionError when it still stages after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        st: dict[str, Any] = json.loads(s.get_text(f"/sglang_l3/prefetch/{hint_id}"))
        if st["state"] != "staging":
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"hint {hint_id} still staging after {timeout} s: {st}")
        time.sleep(0.2)
