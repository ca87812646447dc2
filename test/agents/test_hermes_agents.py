"""Two real Hermes agents at once against the CPU server (issue 30, item 5).

Each agent is the real `hermes` process (hermes-agent 0.19.0, its own venv, a
sandbox: temporary HOME and working directory, only the `file` toolset, writes
confined to the working directory; sglang_l3.testing.hermes). The server is tiny
Qwen3.5 (text) with the README's agent flags translated to CPU (`--tool-call-parser
qwen3_coder --reasoning-parser qwen3 --enable-cache-report`, a long
`--context-length`) and patch scripted-decode: each agent's task names its marker,
and the script makes the model read and write files in that agent's sandbox over
six model calls, then answer. Checked:

- the agents executed every tool call (the sandbox shows the files read and
  written): the calls reached Hermes as `tool_calls`, not text;
- every call of each agent was recorded with the server's own prompt; the
  recorded log-probabilities of every call equal those of a server without any
  cache given the same prompts (replayed as input ids);
- reuse: each call after an agent's first reuses at least 0.9 of the ideal (the
  page-aligned common prefix with that agent's previous prompt plus the server's
  own answer), from the server's own per-request counters.

Elsewhere (issue 30 item 5): L3 on with a small device pool and a restart between
calls (test_hermes_l3_restart.py), Hermes's context compression
(test_hermes_compression.py); the longer run is benchmark/hermes_agents.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from sglang_l3.testing import hermes
from sglang_l3.testing import hermes_scenario as scenario
from sglang_l3.testing.hermes_scenario import CONTEXT, SERVED_NAME, ideal, replay_no_cache, server_config
from sglang_l3.testing.script_writer import answer_step, read_records, tool_step, write_script
from sglang_l3.testing.server import warm_hicache_hash_extension

pytestmark = [pytest.mark.agents, pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 2048


def _steps(work: Path, name: str) -> list[dict[str, Any]]:
    """Six model calls: five tool calls inside the sandbox, then the answer."""
    return [
        tool_step(f"{name}: read the notes.", "read_file", path=str(work / "notes.txt")),
        tool_step(f"{name}: write the copy.", "write_file", path=str(work / "copy.txt"), content=f"copied by {name}"),
        tool_step(f"{name}: check the copy.", "read_file", path=str(work / "copy.txt")),
        tool_step(f"{name}: write the log.", "write_file", path=str(work / "log.txt"), content=f"{name} was here"),
        tool_step(f"{name}: read the log.", "read_file", path=str(work / "log.txt")),
        answer_step(f"{name}: all done.", f"{name} copied the notes."),
    ]


def test_two_hermes_agents_at_once(tmp_path: Path) -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    why = hermes.missing_reason()
    if why:
        pytest.skip(why)
    warm_hicache_hash_extension()
    names = ("agent-amber", "agent-birch")
    base_holder: dict[str, str] = {}
    boxes = {}
    record = tmp_path / "record.jsonl"
    rules = {}
    for n in names:
        # the sandbox exists before the script names its paths; the URL is filled in below
        boxes[n] = tmp_path / n
    for n in names:
        rules[f"Task for {n}"] = _steps(boxes[n] / "work", n)
    script = write_script(tmp_path / "script.json", record, rules, record_prompt_ids=True)

    server = scenario.server(tmp_path, "cached", server_config(script)).start()
    try:
        base_holder["url"] = server.base + "/v1"
        sandboxes = {
            # max_tokens: Hermes otherwise asks for 65,536 new tokens, which this context
            # refuses outright (HTTP 400, docs/agents.md)
            n: hermes.Sandbox.create(
                boxes[n], base_url=base_holder["url"], model=SERVED_NAME, context_length=CONTEXT, max_tokens=MAX_TOKENS
            )
            for n in names
        }
        for n, box in sandboxes.items():
            (box.work / "notes.txt").write_text(f"notes of {n}\n")
        done: dict[str, Any] = {}

        def run(n: str) -> None:
            done[n] = sandboxes[n].run(f"Task for {n}: copy notes.txt to copy.txt and keep a log.")

        threads = [threading.Thread(target=run, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.stop()

    rows = read_records(record)
    for n in names:
        proc = done[n]
        (tmp_path / f"{n}.out").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        assert proc.returncode == 0, f"{n}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        work = sandboxes[n].work
        # the agent executed the tool calls it received (files in its sandbox only)
        assert (work / "copy.txt").read_text() == f"copied by {n}", sorted(p.name for p in work.iterdir())
        assert (work / "log.txt").read_text() == f"{n} was here"
        assert f"{n} copied the notes." in proc.stdout, proc.stdout[-2000:]
        mine = [r for r in rows if r["rule"] == f"Task for {n}"]
        assert [r["step"] for r in mine] == [0, 1, 2, 3, 4, 5], [(r["step"], r["prompt_tokens"]) for r in mine]

    # the same prompts (the server's own, as recorded) against a server without any cache
    bad = replay_no_cache(rows, rules, tmp_path)
    assert not bad, f"differs from the no-cache server: {bad}"

    report = []
    short = []
    for n in names:
        mine = [r for r in rows if r["rule"] == f"Task for {n}"]
        for prev, cur in zip(mine, mine[1:], strict=False):
            want = ideal(prev, cur)
            got = cur["cached"]["total"]
            report.append(f"{n} step {cur['step']}: prompt {cur['prompt_tokens']} cached {got} ideal {want}")
            if got < 0.9 * want:
                short.append(report[-1])
    print("\n".join(report))
    (tmp_path / "reuse.json").write_text(json.dumps(report))
    assert not short, "reuse below 0.9 of the ideal:\n" + "\n".join(short)
