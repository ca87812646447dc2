"""Patch scripted-decode's script (sglang_l3.cpu_serving.decode_script): the
step a prompt rendered by the real Qwen3.5 template selects, and the text of a step
read back by upstream's own Qwen3.5 parsers (qwen3_coder tool calls, qwen3
reasoning) as a tool call and reasoning, not as content. Bad scripts are errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sglang_l3.cpu_serving.decode_script import ScriptError, load, parse, tool_results_since_query
from sglang_l3.testing.script_writer import answer_step, read_records, tool_step, write_script
from sglang_l3.testing.server import MODELS_DIR

TOOLS = [
    {
        "type": "function",
        "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
        },
    },
]


def _tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODELS_DIR / "tiny-qwen35-text"))


def _script(tmp_path: Path):
    path = write_script(
        tmp_path / "s.json",
        tmp_path / "r.jsonl",
        {
            "agent-a": [
                tool_step("First the notes.", "read_file", path="notes.txt"),
                tool_step("Now write.", "write_file", path="out.txt", content="two\nlines"),
                answer_step("All done.", "Copied."),
            ]
        },
    )
    return load(path)


def _call(name: str, args: dict) -> dict:
    # as the server renders history: upstream parses the JSON arguments to a mapping
    # (serving_chat normalize_assistant_tool_call_arguments), which the template iterates
    return {"id": f"c-{name}", "type": "function", "function": {"name": name, "arguments": args}}


def test_the_step_is_the_number_of_tool_results_since_the_last_query(tmp_path: Path) -> None:
    tok, script = _tok(), _script(tmp_path)
    msgs = [{"role": "system", "content": "I am agent-a."}, {"role": "user", "content": "copy notes"}]

    def step(m: list) -> int:
        text = tok.apply_chat_template(m, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        chosen = script.choose(text)
        assert chosen is not None
        return chosen[1]

    assert step(msgs) == 0
    msgs += [{"role": "assistant", "content": "", "tool_calls": [_call("read_file", {"path": "notes.txt"})]}]
    msgs += [{"role": "tool", "tool_call_id": "c-read_file", "content": "hello"}]
    assert step(msgs) == 1
    msgs += [{"role": "assistant", "content": "", "tool_calls": [_call("write_file", {"path": "o", "content": "x"})]}]
    msgs += [{"role": "tool", "tool_call_id": "c-write_file", "content": "ok"}]
    assert step(msgs) == 2
    msgs += [{"role": "assistant", "content": "Copied."}, {"role": "user", "content": "again"}]
    assert step(msgs) == 0, "a new user query starts the script over"
    assert script.choose("no marker here") is None
    assert tool_results_since_query("<|im_start|>user\nq<|im_end|>\n<|im_start|>user\n<tool_response>\nx") == 1


def test_a_step_reads_back_as_a_tool_call_and_reasoning_with_upstreams_parsers(tmp_path: Path) -> None:
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.qwen3_coder_detector import Qwen3CoderDetector
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    script = _script(tmp_path)
    tools = [Tool(**t) for t in TOOLS]
    steps = script.rules[0].steps
    for step, want in zip(
        steps[:2], ({"path": "notes.txt"}, {"path": "out.txt", "content": "two\nlines"}), strict=True
    ):
        # the generation prompt already opened <think>: the model's text starts inside it
        reasoning, rest = ReasoningParser("qwen3", force_reasoning=True).parse_non_stream(step.text())
        assert reasoning.strip() == step.reasoning
        result = Qwen3CoderDetector().detect_and_parse(rest, tools)
        assert not result.normal_text.strip(), result.normal_text
        assert [c.name for c in result.calls] == [step.tool]
        assert json.loads(result.calls[0].parameters) == want
    reasoning, rest = ReasoningParser("qwen3", force_reasoning=True).parse_non_stream(steps[2].text())
    assert reasoning.strip() == "All done." and rest.strip() == "Copied."


def test_tokens_of_a_step_keep_the_special_tokens(tmp_path: Path) -> None:
    tok, step = _tok(), _script(tmp_path).rules[0].steps[0]
    ids = tok.encode(step.text(), add_special_tokens=False)
    for special in ("</think>", "<tool_call>", "</tool_call>"):
        assert ids.count(tok.convert_tokens_to_ids(special)) == 1, special
    assert tok.decode(ids, skip_special_tokens=False) == step.text()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"rules": []}, "record"),
        ({"record": "r", "rules": []}, "rules"),
        ({"record": "r", "rules": [{"marker": "", "steps": [{"reasoning": "x", "answer": "y"}]}]}, "marker"),
        ({"record": "r", "rules": [{"marker": "m", "steps": [{"reasoning": "x"}]}]}, "tool .and arguments. or"),
        (
            {"record": "r", "rules": [{"marker": "m", "steps": [{"reasoning": "a</think>", "answer": "y"}]}]},
            "reasoning",
        ),
        ({"record": "r", "rules": [{"marker": "m", "steps": [{"reasoning": "x", "tool": "a b"}]}]}, "tool"),
        (
            {
                "record": "r",
                "rules": [{"marker": "m", "steps": [{"reasoning": "x", "tool": "t", "arguments": {"p": 1}}]}],
            },
            "arguments.p",
        ),
        ({"record": "r", "rules": [{"marker": "m", "steps": [{"reasoning": "x", "answer": "y", "z": 1}]}]}, "unknown"),
    ],
)
def test_a_bad_script_is_an_error_naming_the_field(bad: dict, match: str) -> None:
    with pytest.raises(ScriptError, match=match):
        parse(bad)


def test_an_unreadable_script_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ScriptError, match="cannot read"):
        load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ScriptError, match="cannot read"):
        load(tmp_path / "bad.json")
    assert read_records(tmp_path / "none.jsonl") == []
