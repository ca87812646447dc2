"""Scripted decode (patch scripted-decode): what the CPU test server's dummy-weight
model "says", chosen from each request's own prompt, and the record of the model's
own log-probability of every token it was made to say.

A script (JSON, named by SGLANG_L3_SCRIPTED_DECODE) is a list of rules:

    {"record": "/tmp/x/record.jsonl",
     "rules": [{"marker": "agent-a", "steps": [
         {"reasoning": "read it", "tool": "read_file", "arguments": {"path": "a.txt"}},
         {"reasoning": "done", "answer": "It says hello."}]}]}

The first rule whose `marker` occurs in the decoded prompt applies; its step is the
number of tool results after the last user message that is not itself a tool
result (Qwen3.5's template renders tool results as `<tool_response>` in a user
turn), the last step once they run out. A step's text is what Qwen3.5 writes after
its generation prompt (`<think>\\n`): the reasoning, `</think>`, then one XML tool
call or the answer, then `<|im_end|>`. A prompt that no rule matches decodes freely.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_l3 import envs

ENV = "SGLANG_L3_SCRIPTED_DECODE"
USER_TURN = "<|im_start|>user\n"
TOOL_RESPONSE = "<tool_response>"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


class ScriptError(ValueError):
    """A script file that cannot be used (named by path and field)."""


@dataclass(frozen=True)
class Step:
    reasoning: str
    tool: str | None = None
    arguments: tuple[tuple[str, str], ...] = ()
    answer: str = ""

    def text(self) -> str:
        """What the model writes after `<think>\\n` (without the end-of-turn token)."""
        head = f"{self.reasoning}\n</think>\n\n"
        if self.tool is None:
            return head + self.answer
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in self.arguments)
        return head + f"<tool_call>\n<function={self.tool}>\n{params}</function>\n</tool_call>"


@dataclass(frozen=True)
class Rule:
    marker: str
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Script:
    record: Path
    rules: tuple[Rule, ...]
    record_prompt_ids: bool = False

    def choose(self, prompt: str) -> tuple[Rule, int] | None:
        """(rule, step index) for a decoded prompt, or None when no rule matches."""
        for rule in self.rules:
            if rule.marker in prompt:
                return rule, min(tool_results_since_query(prompt), len(rule.steps) - 1)
        return None


def tool_results_since_query(prompt: str) -> int:
    """Tool results after the last user turn that is not itself a tool result."""
    start = 0
    for m in re.finditer(re.escape(USER_TURN), prompt):
        if not prompt.startswith(TOOL_RESPONSE, m.end()):
            start = m.end()
    return prompt.count(TOOL_RESPONSE, start)


def _step(where: str, raw: Any) -> Step:
    if not isinstance(raw, dict):
        raise ScriptError(f"{where}: a step is an object, got {type(raw).__name__}")
    unknown = set(raw) - {"reasoning", "tool", "arguments", "answer"}
    if unknown:
        raise ScriptError(f"{where}: unknown keys {sorted(unknown)}")
    reasoning = raw.get("reasoning", "")
    if not isinstance(reasoning, str) or not reasoning or "</think>" in reasoning:
        raise ScriptError(f"{where}.reasoning: a non-empty string without </think>")
    tool = raw.get("tool")
    if tool is None:
        answer = raw.get("answer")
        if not isinstance(answer, str) or not answer or "arguments" in raw:
            raise ScriptError(f"{where}: a step has a tool (and arguments) or a non-empty answer")
        return Step(reasoning=reasoning, answer=answer)
    if not isinstance(tool, str) or not _NAME.match(tool) or "answer" in raw:
        raise ScriptError(f"{where}.tool: a function name, and no answer beside it")
    args = raw.get("arguments", {})
    if not isinstance(args, dict) or not all(isinstance(k, str) and _NAME.match(k) for k in args):
        raise ScriptError(f"{where}.arguments: an object of parameter names")
    for k, v in args.items():
        if not isinstance(v, str) or "</parameter>" in v:
            raise ScriptError(f"{where}.arguments.{k}: a string (without </parameter>)")
    return Step(reasoning=reasoning, tool=tool, arguments=tuple(args.items()))


def parse(obj: Any, where: str = "script") -> Script:
    if not isinstance(obj, dict) or set(obj) - {"record", "rules", "record_prompt_ids"}:
        raise ScriptError(f"{where}: an object with record, rules (and record_prompt_ids)")
    record = obj.get("record")
    if not isinstance(record, str) or not record:
        raise ScriptError(f"{where}.record: the path of the record file")
    rules_raw = obj.get("rules")
    if not isinstance(rules_raw, list) or not rules_raw:
        raise ScriptError(f"{where}.rules: a non-empty list")
    rules = []
    for i, r in enumerate(rules_raw):
        w = f"{where}.rules[{i}]"
        if not isinstance(r, dict) or set(r) != {"marker", "steps"}:
            raise ScriptError(f"{w}: an object with marker and steps")
        if not isinstance(r["marker"], str) or not r["marker"]:
            raise ScriptError(f"{w}.marker: a non-empty string")
        if not isinstance(r["steps"], list) or not r["steps"]:
            raise ScriptError(f"{w}.steps: a non-empty list")
        rules.append(Rule(r["marker"], tuple(_step(f"{w}.steps[{j}]", s) for j, s in enumerate(r["steps"]))))
    return Script(record=Path(record), rules=tuple(rules), record_prompt_ids=bool(obj.get("record_prompt_ids")))


def load(path: str | os.PathLike[str]) -> Script:
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ScriptError(f"{ENV}={path}: cannot read the script: {e}") from None
    return parse(obj, where=str(path))


def configured() -> Script:
    """The script SGLANG_L3_SCRIPTED_DECODE names (a bad one is an error)."""
    path = envs.value(ENV).strip()
    if not path:
        raise ScriptError(f"{ENV} is not set")
    return load(path)


@dataclass
class Forced:
    """One request's scripted tokens and what the model said of them."""

    rid: str
    rule: str
    step: int
    tokens: list[int]
    prompt_ids: list[int]
    pos: int = 0
    logprobs: list[float] = field(default_factory=list)
    # the request's cached prompt tokens as the server counted them (upstream's Req
    # counters: total, device, host, L3), taken when the script finished
    cached: dict[str, int] = field(default_factory=dict)
    session: str | None = None  # the request's session id (an implicit one: the server's)

    def record(self, with_prompt: bool) -> dict[str, Any]:
        ids = self.prompt_ids
        row: dict[str, Any] = {
            "rid": self.rid,
            "rule": self.rule,
            "step": self.step,
            "prompt_tokens": len(ids),
            "prompt_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
            "tokens": self.tokens,
            "logprobs": self.logprobs,
            "cached": self.cached,
            "session": self.session,
        }
        if with_prompt:
            row["prompt_ids"] = ids
        return row


class Recorder:
    """Appends one JSON line per finished script (rank 0 only writes)."""

    def __init__(self, path: Path, write: bool) -> None:
        self.path = path
        self.write = write
        self._lock = threading.Lock()

    def add(self, row: dict[str, Any]) -> None:
        if not self.write:
            return
        line = json.dumps(row) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)
            f.flush()
