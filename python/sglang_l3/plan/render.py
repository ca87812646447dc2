"""`sglang-l3 plan`'s text output (the JSON output is `Plan.to_json()`)."""

from __future__ import annotations

import json
import shlex

from sglang_l3.plan.planner import Plan


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def launch_command(p: Plan, model_path: str = "<model>") -> str:
    lines = ["python -m sglang.launch_server", f"--model-path {model_path}", *p.flags]
    lines.append(f"--hicache-storage-backend-extra-config {shlex.quote(json.dumps(p.store_config))}")
    return " \\\n  ".join(lines)


def text(p: Plan) -> str:
    w = "estimate from config.json" if p.weights_estimated else "given"
    rc = "n/a" if p.recompute_s is None else f"{p.recompute_s:.1f} s"
    out = [
        f"plan: {p.model} ({p.model_source}), TP={p.tp}, {p.quant}, {p.agents} agent(s) x {p.context} tokens",
        "",
        "per rank",
        f"  weights                {_gib(p.weights_bytes)} ({w})",
        f"  KV per token           {p.kv_bytes_per_token:,} B",
        f"  state per checkpoint   {p.state_bytes:,} B ({_mib(p.state_bytes)}, worth "
        f"{p.state_bytes // p.kv_bytes_per_token:,} tokens of KV)",
        f"  one context            KV {_gib(p.context_kv_bytes)} + {p.states_per_context} checkpoints "
        f"{_gib(p.context_state_bytes)}",
        f"  device pools           {p.device_kv_tokens:,} KV tokens + {p.device_mamba_slots} (+1) Mamba slots "
        f"= {_gib(p.device_pool_budget)} after the weights",
        f"  host staging (buffer)  {p.host_kv_tokens:,} KV tokens + {p.host_mamba_slots} states = "
        f"{_gib(p.host_bytes)} (all ranks {_gib(p.host_bytes_all_ranks)})",
        "",
        "contexts that fit",
        f"  device                 {p.device_contexts} (running at once: {p.max_running_requests})",
        f"  host RAM               {p.host_contexts} (buffer-only: the host pools stage writes and restores)",
        f"  L3                     {p.l3_contexts} ({_gib(p.l3_context_bytes)} each, all ranks; cap {_gib(p.l3_cap)})",
        "",
        f"an agent back from L3 ({_gib(p.restore_read_bytes)} per rank: its KV + the last checkpoint)",
        f"  disk read              {p.restore_disk_s:.1f} s at {p.disk_read_gbps:g} GB/s, {p.tp} rank(s) "
        f"sharing it ({p.disk_source})",
        f"  host -> device         {p.restore_h2d_s:.1f} s at {p.link_gbps:g} GB/s per GPU ({p.link_source})",
        f"  expected               {p.restore_s:.1f} s (the two overlap: pieces stream)",
        f"  recompute instead      {rc} ({p.recompute_source})",
    ]
    if p.switch_s is not None and p.switch_disk_s is not None and p.switch_read_bytes is not None:
        out += [
            "",
            f"the agent switch ({p.device_contexts} of {p.agents} contexts on the device: an agent that speaks "
            "after another one waits for its context from L3)",
            f"  switch at disk rate    {p.switch_disk_s:.1f} s ({_gib(p.switch_read_bytes)} per rank at "
            f"{p.disk_read_gbps:g} GB/s, {p.tp} rank(s) sharing the disk: the disk read above)",
            f"  switch measured        {p.switch_s:.1f} s ({p.switch_disk_s:.1f} s x {p.switch_vs_store:g}: "
            "benchmark/agent_switch.py's switch against the store's read of the same bytes, 2026-12-05, "
            "the wait for the other agent's write included)",
        ]
    if p.notes:
        out += ["", "notes", *(f"  - {n}" for n in p.notes)]
    out += ["", "launch", "  " + launch_command(p).replace("\n", "\n  ")]
    return "\n".join(out)
