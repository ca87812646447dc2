"""Hermes's context compression fires inside a real agent run against the CPU server,
and the conversation goes on (issue 30, item 5).

One real `hermes -z … -t file` agent (sandbox as in test_hermes_agents.py), tiny
Qwen3.5 with the README's agent flags, patch scripted-decode. Hermes refuses a
window under 64,000 tokens, and compresses once the prompt passes 85 % of its
input budget (`context_length - max_tokens`) when that is below its 64,000-token
floor (hermes-agent 0.19.0, agent/context_compressor.py); so the agent is told
`context_length: 64000` and a `max_tokens` that puts the trigger ~3,500 tokens
above the bare prompt, and its first tool call reads a notes file of ~10,000 tokens.
The script (first matching marker wins):

- Hermes's summariser call (its preamble) answers with a summary that names a
  marker of its own;
- a prompt that carries that summary (after compaction) writes the copy and the
  log (again: its step counts the tool results the compaction left), then answers;
- before it: read the big notes, write the copy, read it, write the log, read it,
  answer.

Checked: compression fired (the summariser was called) and the agent called the
model again after it, finished with its answer and wrote the files; every call's
tokens and log-probabilities (summariser included) equal a no-cache server's
given the same prompts. Printed, not asserted: each agent call's prompt, cached
tokens and the ideal (common page-aligned prefix with the previous call + its
answer): what reuse survives the compaction.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from sglang_l3.testing import hermes
from sglang_l3.testing.hermes_scenario import (
    SERVED_NAME,
    ideal,
    replay_no_cache,
    server,
    server_config,
    task_marker,
    task_prompt,
)
from sglang_l3.testing.script_writer import answer_step, read_records, tool_step, write_script

pytestmark = [pytest.mark.agents, pytest.mark.e2e, pytest.mark.slow]

NAME = "agent-cedar"
HERMES_CONTEXT = 64000  # Hermes's minimum window (MINIMUM_CONTEXT_LENGTH)
BARE_PROMPT = 6680  # the agent's first prompt in the tiny tokenizer (file toolset), measured
TRIGGER = BARE_PROMPT + 3500  # above the prompt after a compaction (~8,200), below the first after the big read
# Hermes: trigger = 0.85 * (context_length - max_tokens) when its 64,000 floor exceeds that
HERMES_MAX_TOKENS = HERMES_CONTEXT - math.ceil(TRIGGER / 0.85)
SERVER_CONTEXT = 81920  # the prompt + Hermes's max_tokens must fit the server's window
NOTES_LINES = 250  # ~10,000 tokens as Hermes's read_file returns them (numbered lines)
SUMMARISER = "You are a summarization agent creating a context checkpoint"
SUMMARY_MARKER = f"COMPACTED-{NAME}"


def _rules(work: Path) -> dict[str, list[dict[str, object]]]:
    return {
        SUMMARISER: [answer_step("summarise.", f"{SUMMARY_MARKER}: {NAME} read notes.txt and is copying it.")],
        # the step is the number of tool results since the last user turn, which the
        # compaction changes: every step but the answer writes (again) what is left
        SUMMARY_MARKER: [
            tool_step(
                f"{NAME}: write the copy again.", "write_file", path=str(work / "copy.txt"), content=f"copied by {NAME}"
            ),
            tool_step(f"{NAME}: write the log.", "write_file", path=str(work / "log.txt"), content=f"{NAME} was here"),
            tool_step(
                f"{NAME}: write the log again.", "write_file", path=str(work / "log.txt"), content=f"{NAME} was here"
            ),
            answer_step(f"{NAME}: all done.", f"{NAME} copied the notes."),
        ],
        task_marker(NAME): [
            tool_step(f"{NAME}: read the notes.", "read_file", path=str(work / "notes.txt")),
            tool_step(
                f"{NAME}: write the copy.", "write_file", path=str(work / "copy.txt"), content=f"copied by {NAME}"
            ),
            tool_step(f"{NAME}: check the copy.", "read_file", path=str(work / "copy.txt")),
            tool_step(f"{NAME}: write the log.", "write_file", path=str(work / "log.txt"), content=f"{NAME} was here"),
            tool_step(f"{NAME}: read the log.", "read_file", path=str(work / "log.txt")),
            answer_step(f"{NAME}: all done.", f"{NAME} copied the notes."),
        ],
    }


def test_hermes_compression_fires_and_goes_on(tmp_path: Path) -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    why = hermes.missing_reason()
    if why:
        pytest.skip(why)
    record = tmp_path / "record.jsonl"
    rules = _rules(tmp_path / NAME / "work")
    script = write_script(tmp_path / "script.json", record, rules, record_prompt_ids=True)
    s = server(tmp_path, "cached", server_config(script, context=SERVER_CONTEXT)).start()
    try:
        box = hermes.Sandbox.create(
            tmp_path / NAME,
            base_url=s.base + "/v1",
            model=SERVED_NAME,
            context_length=HERMES_CONTEXT,
            max_tokens=HERMES_MAX_TOKENS,
            compression={"protect_first_n": 1, "protect_last_n": 3},
        )
        (box.work / "notes.txt").write_text(
            "".join(f"notes of {NAME}, line {i:03d}: keep this line exactly as it is.\n" for i in range(NOTES_LINES))
        )
        proc = box.run(task_prompt(NAME))
    finally:
        s.stop()

    (tmp_path / f"{NAME}.out").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    rows = read_records(record)
    report = []
    prev = None
    for r in rows:
        line = f"{r['rule'][:24]:24} step {r['step']}: prompt {r['prompt_tokens']} cached {r['cached'].get('total', 0)}"
        if r["rule"] != SUMMARISER:
            if prev is not None:
                line += f" ideal {ideal(prev, r)}"
            prev = r
        report.append(line)
    print("\n".join(report))
    (tmp_path / "reuse.json").write_text(json.dumps(report, indent=1))

    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert f"{NAME} copied the notes." in proc.stdout, proc.stdout[-2000:]
    rules_seen = [r["rule"] for r in rows]
    assert SUMMARISER in rules_seen, f"compression never fired: {report}"
    first_summary = rules_seen.index(SUMMARISER)
    assert SUMMARY_MARKER in rules_seen[first_summary:], f"no agent call after the compaction: {report}"
    assert rules_seen[0] == task_marker(NAME) and rows[0]["step"] == 0, report
    work = box.work
    assert (work / "copy.txt").read_text() == f"copied by {NAME}"
    assert (work / "log.txt").read_text() == f"{NAME} was here"

    bad = replay_no_cache(rows, rules, tmp_path, context=SERVER_CONTEXT)
    assert not bad, "differs from the no-cache server: " + ", ".join(bad)
