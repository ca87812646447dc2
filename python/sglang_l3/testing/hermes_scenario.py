"""The two-Hermes-agents scenario shared by test/agents and benchmark/hermes_agents.py:
the CPU server with the README's agent flags, the scripted model's steps (tool calls
inside each agent's sandbox, then the answer), the ideal reuse of a call, and the
replay of the recorded prompts against a server without any cache.

    rules = {task_marker(n): steps(box / "work", n, calls=6) for n in names}
    config = server_config(script, storage_dir=store, pool=POOL_ONE_AGENT)
    rows = read_records(record)  # patch scripted-decode's record, one row per call
    ideal(prev_row, row)         # page-aligned common prefix with prev prompt + answer
    replay_no_cache(rows, rules, tmp)  # the same prompts, no cache: same tokens, logprobs
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sglang_l3.testing.script_writer import ENV, answer_step, read_records, tool_step, write_script
from sglang_l3.testing.server import Server, ServerConfig

MODEL = "tiny-qwen35-text"
SERVED_NAME = "tiny-qwen35"
CONTEXT = 65536
PAGE = 64
STARTUP_TIMEOUT = float(os.environ.get("SGLANG_L3_E2E_STARTUP_TIMEOUT", "420"))
# calls the no-cache replay sends at once (measured on a Hermes restart record, 2 cores:
# 112.6 s one at a time, 81.6 s four at a time, the same tokens and logprobs)
REPLAY_CONCURRENCY = 4


def agent_flags(context: int = CONTEXT) -> list[str]:
    """The README's agent flags (docs/agents.md), with this context length."""
    return [
        "--tool-call-parser",
        "qwen3_coder",
        "--reasoning-parser",
        "qwen3",
        "--enable-cache-report",
        "--context-length",
        str(context),
        "--served-model-name",
        SERVED_NAME,
    ]


# Hermes with only the `file` toolset renders to ~6,700 tokens in the tiny tokenizer,
# of which two agents share 5,824 (the system prompt up to the home directory). Each
# agent's first tool call reads its own notes (NOTES_LINES, ~1,600 tokens), so its
# calls grow from ~8,500 to ~9,800 tokens (six calls). A device pool of 168 pages
# holds one agent's longest call plus the output SGLang reserves for it at admission
# (SMALL_POOL_MAX_TOKENS, the agent's `model.max_tokens`), not both agents' contexts
# (~11,200 tokens and more from the second call on), so the agents' calls evict each
# other's own pages, which come back from L3 (measured: from the third call on).
POOL_ONE_AGENT = 10752
NOTES_LINES = 40
SMALL_POOL_MAX_TOKENS = 512  # the script's answers are < 100 tokens
# the host buffer (buffer-only: it stages L3 writes and restores, holds nothing between
# calls) as a fraction of the device pool: 2,752 tokens at POOL_ONE_AGENT, less than
# one agent's context, so restores and writes go through it in pieces
SMALL_HOST_RATIO = 0.25


def host_ratio_args(ratio: float) -> list[str]:
    """--hicache-ratio (after ServerConfig's own 2: the last one wins)."""
    return ["--hicache-ratio", f"{ratio:g}"]


def task_marker(name: str) -> str:
    return f"Task for {name}"


def notes_text(name: str, lines: int = NOTES_LINES) -> str:
    """The notes an agent reads first (its own text: the agents' contexts differ)."""
    return "".join(f"notes of {name}, line {i:03d}: keep this line exactly as it is.\n" for i in range(lines))


def task_prompt(name: str) -> str:
    return f"{task_marker(name)}: copy notes.txt to copy.txt and keep a log."


def steps(work: Path, name: str, calls: int = 6) -> list[dict[str, Any]]:
    """`calls` model calls: read the notes, write the copy, then alternate writing and
    reading the log (calls - 3 of them), then the answer; every path is in `work`."""
    if calls < 3:
        raise ValueError(f"calls must be >= 3, got {calls}")
    out = [
        tool_step(f"{name}: read the notes.", "read_file", path=str(work / "notes.txt")),
        tool_step(f"{name}: write the copy.", "write_file", path=str(work / "copy.txt"), content=f"copied by {name}"),
    ]
    for k in range(calls - 3):
        if k % 2 == 0:
            out.append(
                tool_step(
                    f"{name}: write log entry {k // 2}.",
                    "write_file",
                    path=str(work / "log.txt"),
                    content=f"{name} was here ({k // 2})",
                )
            )
        else:
            out.append(tool_step(f"{name}: read the log.", "read_file", path=str(work / "log.txt")))
    out.append(answer_step(f"{name}: all done.", f"{name} copied the notes."))
    return out


def last_log_entry(name: str, calls: int) -> str | None:
    """What log.txt holds after `calls` scripted calls (None: never written)."""
    writes = (calls - 3 + 1) // 2
    return f"{name} was here ({writes - 1})" if writes else None


def server_config(
    script: Path | None,
    *,
    storage_dir: Path | None = None,
    pool: int = 2 * CONTEXT,
    context: int = CONTEXT,
    extra: list[str] | None = None,
) -> ServerConfig:
    """tiny Qwen3.5 (text) with the agent flags; L3 (the file store) when storage_dir."""
    return ServerConfig(
        model=MODEL,
        skip_tokenizer_init=False,
        storage_dir=str(storage_dir) if storage_dir is not None else None,
        max_total_tokens=pool,
        page_size=PAGE,
        prefetch_threshold=PAGE if storage_dir is not None else None,
        extra_args=agent_flags(context) + list(extra or []),
        env={
            # the tiny model's config says 8192 positions; its rotary embedding has no limit
            "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1",
            **({ENV: str(script)} if script else {}),
        },
    )


def l3_metric_lines(s: Server) -> list[str]:
    """The server's sglang-l3 counters (`l3_` in the name) from /metrics (the server
    needs --enable-metrics), one Prometheus line each."""
    return [x for x in s.get_text("/metrics").splitlines() if "l3_" in x and not x.startswith("#")]


def server(root: Path, name: str, config: ServerConfig) -> Server:
    return Server(config, root / f"{name}-{time.monotonic_ns()}.log", startup_timeout=STARTUP_TIMEOUT)


def ideal(prev: dict[str, Any], cur: dict[str, Any]) -> int:
    """Page-aligned common prefix of this prompt with the previous prompt + its answer."""
    a, b = prev["prompt_ids"] + prev["tokens"], cur["prompt_ids"]
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // PAGE * PAGE


# How much of the ideal the agents' calls must reuse. A hybrid model resumes only where
# the server saved a Mamba state; with patch mamba-prefill-cuts a call's previous call
# leaves one where the call's shared prefix ends (at a branch off the other agent's
# context too, and a grid step early when the previous prompt ends on the grid), so
# every call reaches its ideal: in the runs recorded on 2026-12-06, every call did.
# The 0.1 margin is not for any known shortfall.
REUSE_PER_CALL = 0.9
REUSE_OVERALL = 0.9


def reuse_shortfalls(calls: list[tuple[str, int, int]]) -> list[str]:
    """(label, cached, ideal) per call -> what falls below REUSE_PER_CALL of its ideal,
    and the total below REUSE_OVERALL of the ideals' sum; [] when neither."""
    out = [f"{label}: below {REUSE_PER_CALL} of the ideal" for label, c, want in calls if c < REUSE_PER_CALL * want]
    cached, want = sum(c for _, c, _ in calls), sum(w for _, _, w in calls)
    if cached < REUSE_OVERALL * want:
        out.append(f"all calls: cached {cached} of an ideal {want} ({cached / max(want, 1):.3f} < {REUSE_OVERALL})")
    return out


def replay_no_cache(
    rows: list[dict[str, Any]],
    rules: dict[str, list[dict[str, Any]]],
    root: Path,
    context: int = CONTEXT,
    tp_size: int = 1,
) -> list[str]:
    """The recorded prompts (the server's own) against a server without any cache, of
    the same TP size (dummy weights differ between TP sizes); returns what differs
    (tokens or log-probabilities), [] when every call matches."""
    record = root / "fresh.jsonl"
    script = write_script(root / "fresh.json", record, rules, record_prompt_ids=False)
    config = server_config(script, context=context, extra=["--disable-radix-cache"])
    config.tp_size = tp_size
    fresh = server(root, "fresh", config).start()

    def send(r: dict[str, Any]) -> None:
        body = {
            "input_ids": r["prompt_ids"],
            "sampling_params": {"temperature": 0, "max_new_tokens": len(r["tokens"]) + 8},
        }
        status, out = fresh.post("/generate", body, timeout=1800)
        if status != 200:
            raise RuntimeError(f"no-cache replay: HTTP {status}: {out}")

    try:
        # a few calls at a time: the server batches them (the cached server's answers
        # were batched too), about 28 % less wall time than one at a time on 2 cores
        with ThreadPoolExecutor(REPLAY_CONCURRENCY) as pool:
            futures = [pool.submit(send, r) for r in rows]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)  # the first failure ends the replay
                raise
    finally:
        fresh.stop()
    want = {r["prompt_sha256"]: r for r in read_records(record)}
    bad = []
    for r in rows:
        w = want.get(r["prompt_sha256"])
        if w is None or r["tokens"] != w["tokens"] or r["logprobs"] != w["logprobs"]:
            bad.append(f"{r['rule']} step {r['step']} ({r['prompt_tokens']} prompt tokens)")
    return bad


def reuse_rows(rows: list[dict[str, Any]], marker: str) -> list[dict[str, Any]]:
    """One agent's calls after its first: step, prompt, cached (total, device, L3), ideal."""
    mine = [r for r in rows if r["rule"] == marker]
    out = []
    for prev, cur in zip(mine, mine[1:], strict=False):
        c = cur["cached"]
        out.append(
            {
                "step": cur["step"],
                "prompt": cur["prompt_tokens"],
                "cached": c.get("total", 0),
                "device": c.get("device", 0),
                "host": c.get("host", 0),
                "l3": c.get("storage", 0),
                "ideal": ideal(prev, cur),
            }
        )
    return out
