"""Hermes's context compression fires inside two real agents' runs against the CPU
server with L3 on, and each conversation goes on as its own implicit session (issue
30 item 5, issue 49 item 7).

Two real `hermes -z … -t file` agents at once (sandboxes: sglang_l3.testing.hermes)
that send one system prompt and no session id; tiny Qwen3.5 with the README's agent
flags, buffer-only L3 on the file store (implicit sessions live with it), patch
scripted-decode. Hermes's compression at its default threshold: Hermes refuses a
window under 64,000 tokens, and below its 64,000-token floor it compresses once the
prompt passes 85 % of its input budget (`context_length - max_tokens`; hermes-agent
0.19.0, agent/context_compressor.py); so each agent is told `context_length: 64000`
and a `max_tokens` that puts the trigger ~3,500 tokens above the bare prompt, and its
first tool call reads a notes file of ~10,000 tokens. The script, per agent (first
matching marker wins):

- Hermes's summariser call for that agent (its prompt lists the agent's own tool
  calls as `read_file({...})`, which only the summariser's serialisation writes)
  answers with a summary that names a marker of the agent's;
- a prompt that carries that summary (after compaction) writes the copy and the
  log (again: its step counts the tool results the compaction left), then answers;
- before it: read the big notes, write the copy, read it, write the log, read it,
  answer.

Checked:
- compression fired for each agent (its summariser was called), and the agent called
  the model again after it, finished with its answer and wrote its files;
- sessions (the server's own, recorded per call): each agent's calls, before and
  after its compaction, are one implicit session, the two agents' are two, and the
  summariser calls are none of them. Hermes rebuilds the history when it compacts
  but keeps the system prompt and the first message, so the agent's session
  continues from its root (`implicit_sessions{rewritten}`), and the session table
  demotes the old tail (`session_history_rewritten`);
- reuse: each agent call after its first reuses at least 0.9 of the ideal (the
  page-aligned common prefix with that agent's previous call + the server's answer;
  after a compaction, the system prompt and first message;
  hermes_scenario.reuse_shortfalls), from the server's own per-request counters
  (printed per call);
- every call's tokens and log-probabilities (summariser calls included) equal a
  no-cache server's given the same prompts.
This test also holds what test_hermes_agents.py checked (two agents at once, tool
calls executed in their sandboxes, reuse, logprobs), which it replaced (issue 49 item
5: the suite's time).
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sglang_l3.testing import hermes
from sglang_l3.testing.hermes_scenario import (
    SERVED_NAME,
    ideal,
    replay_no_cache,
    reuse_shortfalls,
    server,
    server_config,
    task_marker,
    task_prompt,
)
from sglang_l3.testing.script_writer import answer_step, read_records, tool_step, write_script

pytestmark = [pytest.mark.agents, pytest.mark.e2e, pytest.mark.slow]

NAMES = ("agent-cedar", "agent-dune")
HERMES_CONTEXT = 64000  # Hermes's minimum window (MINIMUM_CONTEXT_LENGTH)
BARE_PROMPT = 6680  # the agent's first prompt in the tiny tokenizer (file toolset), measured
TRIGGER = BARE_PROMPT + 3500  # above the prompt after a compaction (~8,200), below the first after the big read
# Hermes: trigger = 0.85 * (context_length - max_tokens) when its 64,000 floor exceeds that
HERMES_MAX_TOKENS = HERMES_CONTEXT - math.ceil(TRIGGER / 0.85)
SERVER_CONTEXT = 81920  # the prompt + Hermes's max_tokens must fit the server's window
NOTES_LINES = 250  # ~10,000 tokens as Hermes's read_file returns them (numbered lines)


def summary_marker(name: str) -> str:
    return f"COMPACTED-{name}"


def summariser_marker(work: Path) -> str:
    """What only Hermes's summariser prompt for this agent holds: its serialisation of
    the agent's first tool call, `name(arguments)` (measured: `read_file({"path": "…"})`)."""
    return "read_file(" + json.dumps({"path": str(work / "notes.txt")})


def _rules(work: Path, name: str) -> dict[str, list[dict[str, object]]]:
    mark = summary_marker(name)
    copy = dict(path=str(work / "copy.txt"), content=f"copied by {name}")
    log = dict(path=str(work / "log.txt"), content=f"{name} was here")
    return {
        summariser_marker(work): [answer_step("summarise.", f"{mark}: {name} read notes.txt and is copying it.")],
        # the step is the number of tool results since the last user turn, which the
        # compaction changes: every step but the answer writes (again) what is left
        mark: [
            tool_step(f"{name}: write the copy again.", "write_file", **copy),
            tool_step(f"{name}: write the log.", "write_file", **log),
            tool_step(f"{name}: write the log again.", "write_file", **log),
            answer_step(f"{name}: all done.", f"{name} copied the notes."),
        ],
        task_marker(name): [
            tool_step(f"{name}: read the notes.", "read_file", path=str(work / "notes.txt")),
            tool_step(f"{name}: write the copy.", "write_file", **copy),
            tool_step(f"{name}: check the copy.", "read_file", path=str(work / "copy.txt")),
            tool_step(f"{name}: write the log.", "write_file", **log),
            tool_step(f"{name}: read the log.", "read_file", path=str(work / "log.txt")),
            answer_step(f"{name}: all done.", f"{name} copied the notes."),
        ],
    }


def test_two_hermes_agents_compact_and_keep_their_sessions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_l3 import metrics
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    why = hermes.missing_reason()
    if why:
        pytest.skip(why)
    record = tmp_path / "record.jsonl"
    works = {n: tmp_path / n / "work" for n in NAMES}
    per_agent = {n: _rules(works[n], n) for n in NAMES}
    # first matching marker wins: the summarisers, then the compacted calls, then the tasks
    rules: dict[str, list[dict[str, object]]] = {}
    for k in range(3):
        for n in NAMES:
            marker, steps = list(per_agent[n].items())[k]
            rules[marker] = steps
    script = write_script(tmp_path / "script.json", record, rules, record_prompt_ids=True)
    stats = tmp_path / "stats"
    config = server_config(script, storage_dir=tmp_path / "store", context=SERVER_CONTEXT)
    config.env.update({"SGLANG_L3_PUBLISH_STATS": "1", "SGLANG_L3_STATS_DIR": str(stats)})
    monkeypatch.setenv("SGLANG_L3_STATS_DIR", str(stats))
    done: dict[str, Any] = {}
    s = server(tmp_path, "cached", config).start()
    try:
        boxes = {
            n: hermes.Sandbox.create(
                tmp_path / n,
                base_url=s.base + "/v1",
                model=SERVED_NAME,
                context_length=HERMES_CONTEXT,
                max_tokens=HERMES_MAX_TOKENS,
                compression={"protect_first_n": 1, "protect_last_n": 3},
            )
            for n in NAMES
        }
        for n, box in boxes.items():
            (box.work / "notes.txt").write_text(
                "".join(f"notes of {n}, line {i:03d}: keep this line exactly as it is.\n" for i in range(NOTES_LINES))
            )

        def run(n: str) -> None:
            done[n] = boxes[n].run(task_prompt(n))

        threads = [threading.Thread(target=run, args=(n,)) for n in NAMES]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # published by the server's processes within a second of a change; wait for them
        wanted = ("implicit_sessions{rewritten}", "session_history_rewritten")
        deadline = time.monotonic() + 60
        counters = metrics.collect_published()
        while any(counters.get(k, 0) < len(NAMES) for k in wanted) and time.monotonic() < deadline:
            time.sleep(0.5)
            counters = metrics.collect_published()
    finally:
        s.stop()

    rows = read_records(record)
    report = []
    calls: list[tuple[str, int, int]] = []
    for n in NAMES:
        prev = None
        for r in rows:
            if r["rule"] not in (task_marker(n), summary_marker(n), summariser_marker(works[n])):
                continue
            line = (
                f"{n} {'summariser' if r['rule'].startswith('read_file(') else r['rule'][:24]:24} "
                f"step {r['step']}: prompt {r['prompt_tokens']} cached {r['cached'].get('total', 0)} "
                f"session {str(r.get('session'))[-8:]}"
            )
            if not r["rule"].startswith("read_file("):
                if prev is not None:
                    want = ideal(prev, r)
                    line += f" ideal {want}"
                    calls.append((line, r["cached"].get("total", 0), want))
                prev = r
            report.append(line)
    print("\n".join(report))
    (tmp_path / "reuse.json").write_text(json.dumps(report, indent=1))

    sessions = {}
    for n in NAMES:
        proc = done[n]
        (tmp_path / f"{n}.out").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        assert proc.returncode == 0, f"{n}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert f"{n} copied the notes." in proc.stdout, proc.stdout[-2000:]
        assert (works[n] / "copy.txt").read_text() == f"copied by {n}"
        assert (works[n] / "log.txt").read_text() == f"{n} was here"
        seen = [r["rule"] for r in rows]
        assert summariser_marker(works[n]) in seen, f"{n}: compression never fired: {report}"
        first_summary = seen.index(summariser_marker(works[n]))
        assert summary_marker(n) in seen[first_summary:], f"{n}: no agent call after the compaction: {report}"
        mine = [r for r in rows if r["rule"] in (task_marker(n), summary_marker(n))]
        assert mine[0]["rule"] == task_marker(n) and mine[0]["step"] == 0, report
        ids = {r["session"] for r in mine}
        assert len(ids) == 1 and None not in ids, f"{n}: its calls are not one implicit session: {report}"
        sessions[n] = ids.pop()
    assert len(set(sessions.values())) == len(NAMES), f"the agents share a session: {sessions}"
    summarisers = {r["session"] for r in rows if r["rule"].startswith("read_file(")}
    assert not summarisers & set(sessions.values()), "a summariser call joined an agent's session"
    assert counters.get("implicit_sessions{rewritten}", 0) >= len(NAMES), counters
    assert counters.get("session_history_rewritten", 0) >= len(NAMES), counters

    # every call after an agent's first reuses the ideal prefix (the compacted history is
    # new text: the ideal after a compaction is the system prompt and the first message),
    # within what a hybrid model's saved states allow (hermes_scenario.reuse_shortfalls)
    short = reuse_shortfalls(calls)
    assert not short, "reuse short of the ideal:\n" + "\n".join(short)

    bad = replay_no_cache(rows, rules, tmp_path, context=SERVER_CONTEXT)
    assert not bad, "differs from the no-cache server: " + ", ".join(bad)
