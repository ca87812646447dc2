"""Two real Hermes agents at once, L3 on, a device pool of about one agent's context,
and a server restart between two calls (issue 30, item 5).

Real `hermes -z … -t file` processes in sandboxes (sglang_l3.testing.hermes), tiny
Qwen3.5 with the README's agent flags, patch scripted-decode: six model calls per
agent, five tool calls the agent executes, then the answer; with:

- each agent's first tool call reads its own notes (~1,600 tokens), so the two
  contexts differ by more than a few pages beyond the shared system prompt;
- L3 on (buffer-only HiCache over the `file` store in tmp) and a device pool of
  POOL_ONE_AGENT tokens: one agent's longest call and its output reservation fit,
  not both agents' contexts, so an agent's call after the other agent spoke finds
  its own pages evicted and gets them back from L3;
- a restart: the agents reach the server through a relay (sglang_l3.testing.relay)
  that holds each agent's fifth call; once both are held the server is flushed,
  stopped, and a new one started over the same store; the held calls then go to it.
  The agents' processes never notice (one slow answer each).
- the host buffer: before the restart twice the device pool, so the pages the small
  pool evicted come back from L3 through upstream's staged path; after it a quarter
  of the pool, less than one context, so the two held calls, arriving at once, stream
  their whole contexts back through it in pieces, sharing what they have in common.
  (Until 2026-12-06 each buffer ran the whole scenario, a test each: 125-133 s; one
  run now holds both paths to every check.)

Checked, from the server's own per-request counters (scripted-decode's record):
- each call after an agent's first reuses at least 0.9 of the ideal (the page-aligned
  common prefix with the previous prompt + the server's answer;
  hermes_scenario.reuse_shortfalls);
- before the restart, each agent has a later call whose reuse came (partly) from L3;
- each agent's first call after the restart comes from L3 (the first one back:
  nothing on the device);
- every call's tokens and log-probabilities equal a no-cache server's given the
  same prompts; the agents finish, having executed every tool call in their sandbox.
(Until a streamed restore waited for busy device rows, the quarter buffer's returning
calls were cut to what the busy pool took and recomputed the rest: 0.71-0.73 of the
ideal.)
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from sglang_l3.testing import hermes
from sglang_l3.testing.hermes_scenario import (
    CONTEXT,
    POOL_ONE_AGENT,
    SERVED_NAME,
    SMALL_HOST_RATIO,
    SMALL_POOL_MAX_TOKENS,
    host_ratio_args,
    l3_metric_lines,
    last_log_entry,
    notes_text,
    replay_no_cache,
    reuse_rows,
    reuse_shortfalls,
    server,
    server_config,
    steps,
    task_marker,
    task_prompt,
)
from sglang_l3.testing.many_agents import host_tokens
from sglang_l3.testing.relay import Relay
from sglang_l3.testing.script_writer import read_records, write_script
from sglang_l3.testing.server import warm_hicache_hash_extension

pytestmark = [pytest.mark.agents, pytest.mark.e2e, pytest.mark.slow]

CALLS = 6
HOLD_AT = 4  # the step (0-based call) held for the restart: steps 1-3 before it, 5 after
HOLD_TIMEOUT = 3600.0


class RestartGate:
    """Holds each agent's HOLD_AT-th chat call until `release()`; `wait_all_held()`
    returns once every agent has one held (no call of theirs is then in flight)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.calls = dict.fromkeys(names, 0)
        self.held: set[str] = set()
        self.cond = threading.Condition()
        self.released = threading.Event()

    def __call__(self, path: str, body: bytes) -> None:
        if not path.endswith("/chat/completions"):
            return
        req = json.loads(body or b"{}")
        if not req.get("tools"):
            return  # not an agent turn (an auxiliary call)
        text = json.dumps(req.get("messages", []))
        who = [n for n in self.names if task_marker(n) in text]
        if len(who) != 1:
            return
        n = who[0]
        with self.cond:
            k = self.calls[n]
            self.calls[n] += 1
            if k != HOLD_AT:
                return
            self.held.add(n)
            self.cond.notify_all()
        if not self.released.wait(HOLD_TIMEOUT):
            raise RuntimeError(f"{n}: held call never released")

    def wait_all_held(self, done: dict[str, Any]) -> bool:
        """True once every agent is held; False if an agent finished first."""
        with self.cond:
            while len(self.held) < len(self.names):
                if any(n in done for n in self.names):
                    return False
                self.cond.wait(5.0)
        return True


def l3_counters(s: Any, path: Path) -> None:
    """The server's sglang-l3 counters (l3_*) to a file and stdout, for the report."""
    lines = l3_metric_lines(s)
    path.write_text("\n".join(lines) + "\n")
    print(f"--- {path.name}\n" + "\n".join(x for x in lines if not x.rstrip().endswith(" 0.0")))


def test_two_hermes_agents_l3_small_pool_restart(tmp_path: Path) -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    why = hermes.missing_reason()
    if why:
        pytest.skip(why)
    warm_hicache_hash_extension()
    names = ("agent-amber", "agent-birch")
    store = tmp_path / "store"
    record = tmp_path / "record.jsonl"
    rules = {task_marker(n): steps(tmp_path / n / "work", n, CALLS) for n in names}
    script = write_script(tmp_path / "script.json", record, rules, record_prompt_ids=True)
    config, config_after = (
        server_config(script, storage_dir=store, pool=POOL_ONE_AGENT, extra=["--enable-metrics", *host_ratio_args(r)])
        for r in (2.0, SMALL_HOST_RATIO)
    )

    current = {"server": server(tmp_path, "first", config).start()}
    gate = RestartGate(names)
    relay = Relay(lambda: current["server"].base, gate=gate).start()
    done: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    try:
        sandboxes = {
            n: hermes.Sandbox.create(
                tmp_path / n,
                base_url=relay.base + "/v1",
                model=SERVED_NAME,
                context_length=CONTEXT,
                max_tokens=SMALL_POOL_MAX_TOKENS,
            )
            for n in names
        }
        for n, box in sandboxes.items():
            (box.work / "notes.txt").write_text(notes_text(n))

        def run(n: str) -> None:
            try:
                done[n] = sandboxes[n].run(task_prompt(n), timeout=HOLD_TIMEOUT)
            except BaseException as e:  # reported below, the gate must not wait for it
                errors[n] = e
                done[n] = None

        threads = [threading.Thread(target=run, args=(n,)) for n in names]
        for t in threads:
            t.start()
        held = gate.wait_all_held(done)
        if held:
            before = len(read_records(record))
            # L3 holds what the first server wrote (a flush waits for its storage
            # threads); then a new server over the same store
            l3_counters(current["server"], tmp_path / "l3-first.txt")
            current["server"].flush_cache()
            current["server"].stop()
            current["server"] = server(tmp_path, "restarted", config_after).start()
            # a small host buffer: less than one agent's bare prompt (~6,700 tokens);
            # upstream logs the host pool's size only when it is below the device pool's
            host = host_tokens(current["server"])
            assert host < 6000, host
        gate.released.set()
        for t in threads:
            t.join()
        l3_counters(current["server"], tmp_path / "l3-restarted.txt")
    finally:
        gate.released.set()
        relay.stop()
        current["server"].stop()

    assert not errors, errors
    assert held, f"an agent finished before both were held at call {HOLD_AT}: {sorted(done)}"
    rows = read_records(record)
    for n in names:
        proc = done[n]
        (tmp_path / f"{n}.out").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        assert proc.returncode == 0, f"{n}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        work = sandboxes[n].work
        assert (work / "copy.txt").read_text() == f"copied by {n}", sorted(p.name for p in work.iterdir())
        assert (work / "log.txt").read_text() == last_log_entry(n, CALLS)
        assert f"{n} copied the notes." in proc.stdout, proc.stdout[-2000:]
        mine = [r for r in rows if r["rule"] == task_marker(n)]
        assert [r["step"] for r in mine] == list(range(CALLS)), [(r["step"], r["prompt_tokens"]) for r in mine]

    report: list[str] = []
    calls: list[tuple[str, int, int]] = []
    per_agent = {}
    for n in names:
        per_agent[n] = reuse_rows(rows, task_marker(n))
        for r in per_agent[n]:
            report.append(
                f"{n} step {r['step']}: prompt {r['prompt']} cached {r['cached']} "
                f"(device {r['device']} host {r['host']} L3 {r['l3']}) ideal {r['ideal']}"
                + ("  <- after the restart" if r["step"] == HOLD_AT else "")
            )
            calls.append((report[-1], r["cached"], r["ideal"]))
    print("\n".join(report))
    (tmp_path / "reuse.json").write_text(json.dumps(per_agent, indent=1))
    assert before == 2 * HOLD_AT, f"{before} calls recorded before the restart"

    # every check below is collected, so one failure reports all the shortfalls
    failures = []
    bad = replay_no_cache(rows, rules, tmp_path)
    if bad:
        failures.append("differs from the no-cache server: " + ", ".join(bad))
    short = reuse_shortfalls(calls)
    if short:
        failures.append("reuse short of the ideal:\n" + "\n".join(short))
    for n in names:
        by_step = {r["step"]: r for r in per_agent[n]}
        # the small pool: the other agent's calls evicted some of this agent's pages,
        # which came back from L3
        if not any(by_step[s]["l3"] > 0 for s in range(1, HOLD_AT)):
            failures.append(f"{n}: no call before the restart got reuse from L3")
        # the restart: this agent's reuse came back from L3 (the shared system prompt may
        # already be on the device again when the other agent's held call went first)
        if by_step[HOLD_AT]["l3"] <= 0:
            failures.append(f"{n}: nothing from L3 after the restart: {by_step[HOLD_AT]}")
    first_back = min((per_agent[n][HOLD_AT - 1] for n in names), key=lambda r: r["device"])
    if not (first_back["device"] == 0 and first_back["l3"] == first_back["cached"]):
        failures.append(f"the first call after the restart was not all from L3: {first_back}")
    assert not failures, "\n".join(failures)
