"""Patch scripted-decode through a real server (issue 30, item 3): the `openai`
client drives `/v1/chat/completions` of the CPU server (tiny-qwen35-text, the real
Qwen3.5 chat template, the README's agent flags: `--tool-call-parser qwen3_coder
--reasoning-parser qwen3 --enable-cache-report`) whose dummy-weight model follows a
script chosen from the prompt. The agent loop executes nothing; it appends the
tool results a client would. Checked:

- streamed and non-streamed answers carry the script's tool calls as `tool_calls`
  (never as text) and its thinking as `reasoning_content`; the answer as `content`;
- the same three requests replayed against a server without a radix cache record
  the same forced tokens with identical log-probabilities (bit for bit), while the
  cached server really reused its prefix (`cached_tokens`).
"""

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

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny-qwen35-text"
AGENT_FLAGS = ["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3", "--enable-cache-report"]
MARKER = "scripted-agent-7"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
]
STEPS = [
    tool_step("The notes first.", "read_file", path="notes.txt"),
    tool_step("Now the copy.", "write_file", path="out.txt", content="hello from the notes"),
    answer_step("Both done.", "Copied notes.txt to out.txt."),
]


def _server(root: Path, name: str, extra: list[str]) -> Server:
    script = write_script(root / f"{name}.json", root / f"{name}.jsonl", {MARKER: STEPS})
    config = ServerConfig(
        model=MODEL,
        skip_tokenizer_init=False,
        extra_args=AGENT_FLAGS + extra,
        env={ENV: str(script)},
    )
    return Server(config, root / f"{name}-{time.monotonic_ns()}.log", startup_timeout=STARTUP_TIMEOUT)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    root = tmp_path_factory.mktemp("scripted")
    warm_hicache_hash_extension()
    cached = _server(root, "cached", []).start()
    try:
        fresh = _server(root, "fresh", ["--disable-radix-cache"]).start()
    except BaseException:
        cached.stop()
        raise
    yield {"cached": cached, "fresh": fresh, "root": root}
    fresh.stop()
    cached.stop()


def _client(server: Server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=900, max_retries=0)
    return client, client.models.list().data[0].id


def _call(server: Server, messages: list[dict], stream: bool) -> dict[str, Any]:
    """One call as Hermes makes it (all tools, max_tokens, streaming with usage)."""
    client, model = _client(server)
    kw: dict[str, Any] = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 256}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
        return {
            "content": m.content,
            "reasoning": getattr(m, "reasoning_content", None),
            "calls": calls,
            "finish": r.choices[0].finish_reason,
            "cached": r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else None,
        }
    return asdict(
        read_stream(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    )


def _agent(server: Server) -> tuple[list[list[dict]], list[dict]]:
    """Three calls: read, write (streamed), answer (not streamed); returns each
    call's messages and answer. The history is appended as Hermes does: the
    assistant's tool calls without its reasoning, then the tool results."""
    messages: list[dict] = [
        {"role": "system", "content": f"You are {MARKER}, a careful file clerk."},
        {"role": "user", "content": "Copy notes.txt to out.txt, please."},
    ]
    sent, answers = [], []
    for k in range(3):
        sent.append(json.loads(json.dumps(messages)))
        a = _call(server, messages, stream=k < 2)
        answers.append(a)
        if not a["calls"]:
            break
        messages.append(
            {
                "role": "assistant",
                "content": a["content"] or "",
                "tool_calls": [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in a["calls"]
                ],
            }
        )
        for c in a["calls"]:
            result = "hello from the notes" if c["name"] == "read_file" else "written"
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    return sent, answers


def test_tool_calls_and_reasoning_come_back_parsed_and_logprobs_match_a_fresh_server(servers) -> None:
    root = servers["root"]
    sent, got = _agent(servers["cached"])
    assert len(got) == 3, got
    for a, step in zip(got[:2], STEPS[:2], strict=True):
        assert a["finish"] == "tool_calls", a
        assert [c["name"] for c in a["calls"]] == [step["tool"]], a
        assert json.loads(a["calls"][0]["arguments"]) == step["arguments"], a
        assert a["reasoning"].strip() == step["reasoning"], a
        assert "<tool_call>" not in (a["content"] or "") and "<function=" not in (a["content"] or ""), a
    last = got[2]
    assert last["finish"] == "stop" and not last["calls"], last
    assert last["content"].strip() == STEPS[2]["answer"] and last["reasoning"].strip() == STEPS[2]["reasoning"]
    # each call after the first reused the previous call's prompt from the cache
    assert got[1]["cached"] > 0 and got[2]["cached"] > got[1]["cached"], [a["cached"] for a in got]

    cached = read_records(root / "cached.jsonl")
    assert [r["step"] for r in cached] == [0, 1, 2], cached
    for messages in sent:  # the same requests, as captured, against a server that caches nothing
        _call(servers["fresh"], messages, stream=False)
    fresh = read_records(root / "fresh.jsonl")
    assert len(fresh) == 3
    for c, f in zip(cached, fresh, strict=True):
        assert c["prompt_sha256"] == f["prompt_sha256"] and c["tokens"] == f["tokens"], (c, f)
        assert c["logprobs"] == f["logprobs"], f"step {c['step']}: {c['logprobs']} vs {f['logprobs']}"
        assert len(c["logprobs"]) == len(c["tokens"]) and all(lp <= 0.0 for lp in c["logprobs"])
