"""Patch `tool-pins` through a real server (issue 31 item 2): an agent that sends
no session id calls `/v1/chat/completions` as Hermes does (all tools, streaming,
append-only history) against the CPU server with the README's agent flags and
the sglang-l3 file store; its dummy-weight model answers with tool calls from a
script. With SGLANG_L3_TOOL_PIN=100 (the TTL is the longest gap seen) each turn
that ends in a tool call, once three gaps of 5 s are history, is pinned on the
scheduler; the agent's next call (0.2 s later) ends the pin as a hit; the last
call's pin, never followed, expires. Every forced token and its logprob equal a
server that caches nothing (placement only)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from l3_e2e import STARTUP_TIMEOUT
from sglang_l3.testing.chat_stream import read_stream
from sglang_l3.testing.script_writer import ENV, answer_step, read_records, tool_step, write_script
from sglang_l3.testing.server import Server, ServerConfig, warm_hicache_hash_extension
from test_metrics_server import until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny-qwen35-text"
AGENT_FLAGS = ["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3", "--enable-cache-report"]
MARKER = "pinned-agent-3"
TOOL = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
}
CALLS = 6  # each answered with a tool call; the agent does not come back after the last
STEPS = [tool_step(f"Step {i}.", "run", cmd=f"make step{i}") for i in range(CALLS)] + [
    answer_step("Done.", "All built.")
]
LEARN_S, SHORT_S = 5.0, 0.2  # the first three gaps (the history), then the quick tools
MAX_S = 10.0


def _server(root: Path, name: str, extra: list[str], env: dict[str, str], store: bool) -> Server:
    script = write_script(root / f"{name}.json", root / f"{name}.jsonl", {MARKER: STEPS})
    config = ServerConfig(
        model=MODEL,
        skip_tokenizer_init=False,
        storage_dir=str(root / f"{name}-store") if store else None,
        extra_args=AGENT_FLAGS + extra,
        env={ENV: str(script), **env},
    )
    return Server(config, root / f"{name}-{time.monotonic_ns()}.log", startup_timeout=STARTUP_TIMEOUT)


def _call(server: Server, messages: list[dict]) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=900, max_retries=0)
    model = client.models.list().data[0].id
    kw = {"model": model, "messages": messages, "tools": [TOOL], "max_tokens": 256}
    return asdict(read_stream(client.chat.completions.create(**kw, stream=True)))


def _agent(server: Server) -> list[list[dict]]:
    messages: list[dict] = [
        {"role": "system", "content": f"You are {MARKER}, a build bot."},
        {"role": "user", "content": "Build every step, please."},
    ]
    sent = []
    for k in range(CALLS):
        sent.append(json.loads(json.dumps(messages)))
        a = _call(server, messages)
        assert a["finish"] == "tool_calls" and a["calls"], a
        if k == CALLS - 1:
            break
        messages.append(
            {
                "role": "assistant",
                "content": a["content"],
                "tool_calls": [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in a["calls"]
                ],
            }
        )
        time.sleep(LEARN_S if k < 3 else SHORT_S)
        messages.append({"role": "tool", "tool_call_id": a["calls"][0]["id"], "content": "ok"})
    return sent


def test_a_plain_agents_tool_call_turns_are_pinned_and_answers_match_a_fresh_server(tmp_path, monkeypatch) -> None:
    from sglang_l3 import metrics
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    warm_hicache_hash_extension()
    stats = str(tmp_path / "stats")
    # the server's published counters, read here as `doctor --stats` sums them
    # (test_metrics_server covers the doctor; a doctor process costs ~9 s a poll)
    monkeypatch.setenv("SGLANG_L3_STATS_DIR", stats)
    env = {
        "SGLANG_L3_TOOL_PIN": "100",
        "SGLANG_L3_TOOL_PIN_MAX_S": str(MAX_S),
        "SGLANG_L3_PUBLISH_STATS": "1",
        "SGLANG_L3_STATS_DIR": stats,
    }
    with _server(tmp_path, "pinned", [], env, store=True) as s:
        sent = _agent(s)
        assert len(sent) == CALLS
        # calls 2..4 arrive after the three learning gaps; the answers of calls 4..6 pin
        # (TTL about LEARN_S), calls 5 and 6 return SHORT_S later, the last pin expires
        # one implicit session for the whole agent (the warmup is another); every later call
        # continues it although the template re-renders the input's last token (page size 1:
        # the README's flags leave --page-size to the model's default)
        want = {
            "implicit_sessions{continued}": CALLS - 1,
            "session_tool_turns": CALLS,  # every answer a tool call, each told to the scheduler (tool-call-turns)
            "l3_tool_pin{pinned}": 3,
            "l3_tool_pin{hit}": 2,
            "l3_tool_pin{expired}": 1,
        }
        got = until(
            lambda: {k: metrics.collect_published().get(k, 0) for k in want},
            lambda c: c == want,
            "tool pin counters",
            timeout=60 + MAX_S,
        )
        assert got == want
        rewritten = metrics.collect_published().get("session_history_rewritten", 0)
        assert rewritten == 0, "an ordinary next turn demoted its history"
        log = s.log_text()
        assert "tool pin: cannot" not in log, s.log_tail(40)
    with _server(tmp_path, "fresh", ["--disable-radix-cache"], {}, store=False) as fresh:
        for messages in sent:
            _call(fresh, messages)
    pinned, ref = read_records(tmp_path / "pinned.jsonl"), read_records(tmp_path / "fresh.jsonl")
    assert [r["step"] for r in pinned] == list(range(CALLS))
    assert len(ref) == len(pinned)
    for a, b in zip(pinned, ref, strict=True):
        assert a["prompt_sha256"] == b["prompt_sha256"] and a["tokens"] == b["tokens"], (a["step"], b["step"])
        assert a["logprobs"] == b["logprobs"], f"step {a['step']}"
