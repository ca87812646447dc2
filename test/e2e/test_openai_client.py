"""A real client (issue 23, item 6): the `openai` Python package drives
`/v1/chat/completions` of the CPU server (tiny multimodal Qwen3.5, its tokenizer and
real Qwen3.5 chat template, the README's L3 flags) in a multi-turn agent loop, the
way an agent framework does. The only sglang-specific part is
`extra_body={"session_id": ...}`: upstream's chat route passes it to /generate's
top-level session_id, and patch `sessions` records the session's context for L3
retention (docs/sessions.md).

Before turns 3 and 5 the device cache is flushed: the turn's
`usage.prompt_tokens_details.cached_tokens` (`--enable-cache-report`) can then only
come from L3. In the `image` run, turn 4 adds an image (a data URL, OpenAI's
`image_url` part). Every answer (text, tokens and logprobs) equals a server without
any cache.

Turn 4 of the `image` run prefills an image after a history from the device cache:
it is exact because the CPU attention gives a token the same output however its
prefill is chunked (patch cpu-attention-invariant; without it, ~1e-4 in logprobs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from l3_e2e import restorable
from mm_e2e import Qwen35Servers, data_url, png, release_if_done, shared_servers, tokenizer, wait_stored, words

pytestmark = pytest.mark.e2e

SESSION = "openai-agent-{}"
FLUSH_BEFORE = (2, 4)  # turn indices (0-based)


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory) -> Iterator[Qwen35Servers]:
    yield shared_servers(request, tmp_path_factory)
    release_if_done(request)


def _client(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=900, max_retries=0)
    return client, client.models.list().data[0].id


def _user_message(turn: int, image: bool) -> dict:
    text = words(200 + turn, 90 if turn == 0 else 45)
    if turn != 3 or not image:
        return {"role": "user", "content": text}
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_url(png(250, 128, 128))}},
            {"type": "text", "text": words(260, 20)},
        ],
    }


def _agent_loop(server, session: str, image: bool, flush_before=()) -> list[dict]:
    """Five turns of system + growing history; each turn's answer is appended as the
    assistant message, then a new user message (a tool result, a question)."""
    client, model = _client(server)
    messages: list[dict] = [{"role": "system", "content": "You are agent one. " + words(199, 60)}]
    turns = []
    for turn in range(5):
        messages.append(_user_message(turn, image))
        if turn in flush_before:
            # the previous turn's pages are in L3 (a flush waits for queued writes itself)
            wait_stored(server, session, turns[-1]["prompt_tokens"])
            server.flush_cache()
        r = client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=8,
            logprobs=True,
            extra_body={"session_id": session},
        )
        choice = r.choices[0]
        details = r.usage.prompt_tokens_details
        turns.append(
            {
                "content": choice.message.content,
                "tokens": [t.token for t in choice.logprobs.content],
                "logprobs": [t.logprob for t in choice.logprobs.content],
                "prompt_tokens": r.usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details is not None else None,
            }
        )
        messages.append({"role": "assistant", "content": choice.message.content})
    return turns


@pytest.mark.parametrize("image", [False, True], ids=["text", "image"])
def test_openai_agent_loop_with_session_restores_from_l3(servers: Qwen35Servers, image: bool) -> None:
    l3 = servers.l3
    session = SESSION.format("image" if image else "text")
    l3.flush_cache()
    got = _agent_loop(l3, session, image, flush_before=FLUSH_BEFORE)
    want = _agent_loop(servers.reference, session, image)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        for field in ("content", "tokens", "logprobs", "prompt_tokens"):
            assert g[field] == w[field], f"turn {k + 1}: {field} differs: {g[field]!r} vs {w[field]!r}"
        assert w["cached_tokens"] == 0  # the reference caches nothing
    # the previous prompt ended with the generation prompt's `<think>\n`, which the
    # template does not render back for a history turn: the turns share the rest
    think_open = len(tokenizer()("<think>\n")["input_ids"])
    for k in FLUSH_BEFORE:
        # device and host were flushed: every cached token was restored from L3, at
        # least up to the last checkpoint of what the previous turn's prompt shares
        shared = got[k - 1]["prompt_tokens"] - think_open
        assert got[k]["cached_tokens"] >= restorable(shared) > 0, (k + 1, got[k])
    # the session is recorded for L3 retention (patch sessions), pages on disk
    info = json.loads(l3.get_text("/sglang_l3/sessions"))
    row = next(r for r in info["sessions"] if r["id"] == session)
    assert row["state"] == "open" and row["tokens"] >= got[-1]["prompt_tokens"] and row["restorable_pages"] > 0, row
