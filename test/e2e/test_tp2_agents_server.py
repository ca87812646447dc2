"""Two agents, one pool, at TP=2: the agent features together, through real servers.

The user's case: two agents started by one user send the same system prompt and no
session id; their first messages differ only in the last words. Served at TP=2 (the
user's topology; two CPU rank processes, gloo) by tiny Qwen3.5 (text) with the
README's agent flags, buffer-only HiCache over the `file` store, a device pool that
holds one agent's context (not both), a host buffer of a quarter of it (less than one
context: restores stream through it in pieces), tool pins and the predicted return on
(SGLANG_L3_TOOL_PIN, SGLANG_L3_PREDICTED_RETURN), SGLANG_L3_VERIFY=1 (the ranks compare
every restore decision) and upstream's strict idle leak check (its default, stated).
Each agent streams OpenAI chat completions with a tool, as Hermes does, and appends
each answer and its tool result (a scripted model: patch scripted-decode).

1. Both agents at once, four calls each with gaps to learn from (the pins' history):
   tool-call turns, implicit sessions, their contexts evicting each other.
2. A long break: the device is flushed (contexts in L3 only, pins outstanding). A's
   next call streams its context back from L3 and is cancelled (`/abort_request` with
   its rid) while the stream's reads are held (test fault read-hold); A is idle again.
3. "B speaks next": a hint stages B's context from L3 to the device; B's call then
   reuses it.
4. A retries its cancelled call while B continues; both finish. A's context streams
   back from L3 beside B's call; where the pool cannot hold both and A's stream yields
   its rows to B's call, A asks L3 again (before that fix it recomputed its whole context).

Checked: every answer (forced tokens and their log-probabilities) equals a TP=2
server's without any cache given the same prompts; the agents are two sessions, each
agent's calls one; B's call reused the context the hint staged and A's retry its context from L3 (each
at least 0.9 of the ideal reuse); the abort was taken at the same point on both ranks and freed its rows (the
server stays up; upstream's idle leak check never fired; a final flush is accepted);
each counter that counts per rank grew by a multiple of TP (the ranks decided alike);
the pins were placed on every rank.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from l3_e2e import settled_counters, wait_hint, wait_log
from sglang_l3.testing import hermes_scenario as hs
from sglang_l3.testing.chat_stream import read_stream
from sglang_l3.testing.script_writer import read_records, tool_step, write_script
from sglang_l3.testing.server import Server
from tp2_e2e import DEVICE, REQUEST_TIMEOUT, TEST_BOUND, TP, bounded

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NAMES = ("agent-amber", "agent-birch")
TOOL = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command in the project and return what it printed.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
}
# ~1,000 tokens shared by both agents (the tiny tokenizer); their first messages differ
# in the last word only
SYSTEM = "You are a careful build agent working in a shared repository. " + " ".join(
    f"Rule {i}: read the build log of target {i} before you change anything, keep every step small "
    "and say what you ran."
    for i in range(11)
)
CALLS = 6  # each answered with a tool call
LEARN = 4  # calls 0..3 in phase 1, gaps after 0..2 (the pins' history)
GAP_S = 2.0
POOL = 2048  # one agent's context (~1,250-1,450 tokens) and its output reservation, not both
HOST_RATIO = 0.25  # the host buffer: 512 tokens, less than a context
MAX_TOKENS = 128
PIN_MAX_S = 10.0
LEAK = "memory leak detected"
ABORTED = re.compile(r"streamed restore aborted req=(\S+) reason=aborted landed=(\d+)/(\d+)")


def marker(name: str) -> str:
    return f"Your name is {name}."


def first_messages(name: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Build every target, one step at a time. {marker(name)}"},
    ]


def script_steps(name: str) -> list[dict[str, Any]]:
    return [tool_step(f"{name}: step {i}.", "run", cmd=f"make -C {name} step{i}") for i in range(CALLS)]


class Agent:
    """An append-only chat client (as Hermes): every call streams, with the tool."""

    def __init__(self, name: str, server: Server) -> None:
        from openai import OpenAI

        self.name = name
        self.messages = first_messages(name)
        self.client = OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)
        self.model = self.client.models.list().data[0].id
        self.answers: list[dict[str, Any]] = []

    def call(self, rid: str | None = None) -> dict[str, Any]:
        kw: dict[str, Any] = {"model": self.model, "messages": self.messages, "tools": [TOOL], "max_tokens": MAX_TOKENS}
        if rid is not None:
            kw["extra_body"] = {"rid": rid}
        return dataclasses.asdict(read_stream(self.client.chat.completions.create(**kw, stream=True)))

    def turn(self) -> None:
        """One call, its answer and the tool's result appended (the agent's next call extends it)."""
        a = self.call()
        assert a["finish"] == "tool_calls" and a["calls"], (self.name, a)
        self.answers.append(a)
        c = a["calls"][0]
        self.messages.append(
            {
                "role": "assistant",
                "content": a["content"],
                "tool_calls": [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                ],
            }
        )
        self.messages.append({"role": "tool", "tool_call_id": c["id"], "content": f"{self.name}: ok"})


def _threads(*jobs: Any) -> None:
    errors: list[BaseException] = []

    def run(job: Any) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - re-raised below, with the others
            errors.append(e)

    ts = [threading.Thread(target=run, args=(j,), daemon=True) for j in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def _grown(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(before) | set(after)) if k.startswith(prefix)}


def test_two_agents_one_pool_tp2(tmp_path: Path, hash_extension_built) -> None:
    from sglang_l3.cpu import accelerator_present

    if DEVICE == "cpu" and accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    if DEVICE != "cpu":
        pytest.skip("the scripted agents run on the CPU servers")
    record = tmp_path / "record.jsonl"
    rules = {marker(n): script_steps(n) for n in NAMES}
    script = write_script(tmp_path / "script.json", record, rules, record_prompt_ids=True)
    stats = tmp_path / "stats"
    gate = tmp_path / "read-hold.gate"
    base = hs.server_config(script, storage_dir=tmp_path / "store", pool=POOL, context=8192)
    config = dataclasses.replace(
        base,
        tp_size=TP,
        extra_args=[*base.extra_args, *hs.host_ratio_args(HOST_RATIO)],
        env={
            **base.env,
            "SGLANG_L3_TOOL_PIN": "100",
            "SGLANG_L3_TOOL_PIN_MAX_S": str(PIN_MAX_S),
            "SGLANG_L3_PREDICTED_RETURN": "25",
            "SGLANG_L3_VERIFY": "1",
            "SGLANG_L3_TEST_FAULT": f"read-hold@{gate}",
            "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",  # upstream's default, stated
            "SGLANG_L3_PUBLISH_STATS": "1",
            "SGLANG_L3_STATS_DIR": str(stats),
        },
    )
    s = hs.server(tmp_path, "l3", config).start()
    try:
        with bounded(TEST_BOUND * 2, "two agents at TP=2", lambda: [s]):
            host = int(re.search(r"HiCache kv host pool \((\d+) tokens\)", s.log_text()).group(1))  # type: ignore[union-attr]
            a, b = (Agent(n, s) for n in NAMES)

            # 1. both agents at once, with gaps the pins learn from
            def phase1(agent: Agent) -> None:
                for k in range(LEARN):
                    agent.turn()
                    if k < LEARN - 1:
                        time.sleep(GAP_S)

            _threads(lambda: phase1(a), lambda: phase1(b))
            assert len(a.answers) == len(b.answers) == LEARN
            first = settled_counters(stats)

            # 2. a long break: nothing on the device; A comes back and is cancelled mid-restore
            s.flush_cache(timeout=REQUEST_TIMEOUT)
            gate.write_text("1")
            mark = len(s.log_text())
            rid = "amber-cancelled"
            cancelled: dict[str, Any] = {}

            def cancelled_call() -> None:
                try:
                    cancelled["answer"] = a.call(rid=rid)
                except Exception as e:  # noqa: BLE001 - an aborted call may end either way
                    cancelled["error"] = e

            t = threading.Thread(target=cancelled_call, daemon=True)
            t.start()
            wait_log(s, mark, r"read-hold: piece 1 of a streamed restore waits", "A's stream to hold its reads")
            s.abort(rid)
            wait_log(s, mark, rf"streamed restore aborted req={rid} reason=aborted", "the abort")
            time.sleep(2.0)  # the scheduler is idle now: upstream's leak check runs while the reads are held
            assert s.alive() and LEAK not in s.log_text()[mark:], s.log_tail(80)
            gate.unlink()
            t.join(REQUEST_TIMEOUT)
            s.flush_cache(timeout=REQUEST_TIMEOUT)  # refused until the aborted stream freed its rows
            aborted = [m for m in ABORTED.findall(s.log_text()[mark:]) if m[0] == rid]
            assert len(aborted) == TP and len({m[1:] for m in aborted}) == 1, aborted

            # 3. "B speaks next": staged from L3 onto the device before B's call
            b_rows = [r for r in read_records(record) if r["rule"] == marker(b.name)]
            b_ctx = b_rows[-1]["prompt_ids"] + b_rows[-1]["tokens"]
            code, h = s.post("/sglang_l3/prefetch", {"input_ids": b_ctx})
            assert code == 200, h
            hint = wait_hint(s, h["hint_id"])
            assert hint["state"] == "landed" and hint["cached"]["storage"] > host, hint
            b.turn()

            # 4. A retries while B continues; both finish
            def rest(agent: Agent) -> None:
                while len(agent.answers) < CALLS:
                    agent.turn()
                    time.sleep(0.2)

            _threads(lambda: rest(a), lambda: rest(b))
            assert s.alive() and LEAK not in s.log_text(), s.log_tail(80)
            s.flush_cache(timeout=REQUEST_TIMEOUT)
            last = settled_counters(stats)
    finally:
        s.stop()

    rows = read_records(record)
    mine = {n: [r for r in rows if r["rule"] == marker(n)] for n in NAMES}
    done = {n: [r for r in mine[n] if r["rid"] != rid] for n in NAMES}
    for n in NAMES:
        assert [r["step"] for r in done[n]] == list(range(CALLS)), (n, [(r["rid"], r["step"]) for r in mine[n]])
    # two sessions, each agent's calls one
    sessions = {n: {r["session"] for r in done[n]} for n in NAMES}
    assert all(len(v) == 1 and None not in v for v in sessions.values()), sessions
    assert sessions[NAMES[0]] != sessions[NAMES[1]], "two agents with one system prompt are two sessions"
    # B's call after the hint and A's retry each reused their context up to the ideal (the
    # page-aligned common prefix with the agent's previous call + answer): B's from the
    # staged pages, A's from L3 (when A's stream yields its rows to B's call, it asks L3
    # again: before patch stream-share re-issued that lookup, A recomputed all of it)
    a_retry, b_hinted = done[NAMES[0]][LEARN]["cached"], done[NAMES[1]][LEARN]["cached"]
    print(f"A's retry: {a_retry}; B's call after the hint: {b_hinted}")
    a_ideal, b_ideal = (hs.ideal(done[n][LEARN - 1], done[n][LEARN]) for n in NAMES)
    assert b_hinted.get("total", 0) >= hs.REUSE_PER_CALL * b_ideal, (b_hinted, b_ideal, hint)
    assert a_retry.get("storage", 0) >= hs.REUSE_PER_CALL * a_ideal, (a_retry, a_ideal)

    grown = _grown(first, last, "l3_")
    per_rank = {k: v for k, v in grown.items() if k.startswith(("l3_stream_restore", "l3_tool_pin", "l3_stream_yield"))}
    assert all(v % TP == 0 for v in per_rank.values()), f"a per-rank counter grew unevenly: {per_rank}"
    assert grown.get("l3_stream_restore{started}", 0) >= 2 * TP, grown  # the cancelled call's and the hint's
    pins = _grown({}, last, "l3_tool_pin")
    assert pins.get("l3_tool_pin{pinned}", 0) >= 2 * TP, pins

    # every answer as a TP=2 server without any cache gives it
    bad = hs.replay_no_cache([r for n in NAMES for r in done[n]], rules, tmp_path, context=8192, tp_size=TP)
    assert not bad, "differs from the no-cache TP=2 server: " + ", ".join(bad)
