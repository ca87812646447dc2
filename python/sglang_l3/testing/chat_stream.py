"""A streamed OpenAI chat answer, put back together as an agent client does: the
content, the reasoning, the tool calls (their deltas joined by index), the
finish reason, the cached prompt tokens of the usage chunk, and when the first
token arrived. Used by the e2e agent tests and benchmark/agents.py.

    t0 = time.perf_counter()
    answer = read_stream(client.chat.completions.create(..., stream=True), t0)
    messages.append(answer.message())
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamedAnswer:
    content: str = ""
    reasoning: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"id", "name", "arguments"}
    finish: str | None = None
    cached: int | None = None  # usage.prompt_tokens_details.cached_tokens (stream_options include_usage)
    first_token_s: float | None = None  # seconds from t0 to the first content, reasoning or tool-call delta

    def message(self) -> dict[str, Any]:
        """The assistant message an append-only client sends back (no reasoning, as Hermes)."""
        return {
            "role": "assistant",
            "content": self.content,
            "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.calls
            ],
        }


def read_stream(chunks: Iterable[Any], t0: float | None = None) -> StreamedAnswer:
    """Consume an openai-python chat completion stream; `t0` (time.perf_counter())
    starts the first-token clock."""
    out = StreamedAnswer()
    for chunk in chunks:
        usage = getattr(chunk, "usage", None)
        if usage is not None and usage.prompt_tokens_details is not None:
            out.cached = usage.prompt_tokens_details.cached_tokens
        for choice in chunk.choices:
            d = choice.delta
            reasoning = getattr(d, "reasoning_content", None) or ""
            if t0 is not None and out.first_token_s is None and (d.content or reasoning or d.tool_calls):
                out.first_token_s = time.perf_counter() - t0
            out.content += d.content or ""
            out.reasoning += reasoning
            for tc in d.tool_calls or []:
                while len(out.calls) <= tc.index:
                    out.calls.append({"id": None, "name": "", "arguments": ""})
                c = out.calls[tc.index]
                c["id"] = tc.id or c["id"]
                if tc.function is not None:
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
            out.finish = choice.finish_reason or out.finish
    return out
