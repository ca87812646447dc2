"""Test side of patch scripted-decode: write a script for the CPU test server
(`ServerConfig.env[SGLANG_L3_SCRIPTED_DECODE]`) and read what it recorded.

    script = write_script(tmp / "script.json", tmp / "record.jsonl", {"agent-a": [
        tool_step("read it", "read_file", path="a.txt"), answer_step("done", "It says hi.")]})
    ... requests ...
    rows = read_records(tmp / "record.jsonl")  # one per finished scripted answer

The rules and their meaning: sglang_l3.cpu_serving.decode_script.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang_l3.cpu_serving.decode_script import ENV, parse

__all__ = ["ENV", "answer_step", "read_records", "tool_step", "write_script"]


def tool_step(reasoning: str, tool: str, **arguments: str) -> dict[str, Any]:
    return {"reasoning": reasoning, "tool": tool, "arguments": dict(arguments)}


def answer_step(reasoning: str, answer: str) -> dict[str, Any]:
    return {"reasoning": reasoning, "answer": answer}


def write_script(
    path: Path, record: Path, rules: dict[str, list[dict[str, Any]]], record_prompt_ids: bool = False
) -> Path:
    """Write (and validate) a script: marker -> steps, first matching marker wins."""
    obj = {
        "record": str(record),
        "record_prompt_ids": record_prompt_ids,
        "rules": [{"marker": m, "steps": steps} for m, steps in rules.items()],
    }
    parse(obj, where=str(path))
    path.write_text(json.dumps(obj, indent=1))
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    """The recorded scripted answers, in the order they finished (none yet: [])."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
