"""`sglang-l3 plan`'s arithmetic against values derived by hand from config.json
fields, its refusals, its agreement with benchmark/restore_bench.py's geometry
and with upstream's sizing constants, and the CLI."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_l3.plan import models, weights
from sglang_l3.plan.geometry import Geometry
from sglang_l3.plan.planner import (
    HOST_RESERVE_BYTES,
    MAMBA_SLOTS_PER_REQUEST,
    SWITCH_VS_STORE,
    Inputs,
    PlanError,
    make_plan,
)

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]


def _geometry(name: str) -> Geometry:
    return Geometry.from_config(models.load(name)[1])


def _inputs(name: str = "Qwen3.5-27B", **kw) -> Inputs:
    n, config, source = models.load(name)
    base = dict(model=n, config=config, model_source=source, quant="gptq-4bit", tp=2, agents=2, context=262144)
    base.update(kw)
    return Inputs(**base)


# --- per-rank bytes, by hand from the config.json fields --------------------------------


def test_qwen35_27b_tp2_matches_the_state_budget_figures() -> None:
    g = _geometry("Qwen3.5-27B")
    # 64 layers, full_attention_interval 4 -> 16 full, 48 GDN
    assert (g.full_layers, g.gdn_layers) == (16, 48)
    # 16 layers x (K, V) x 4/2 KV heads x 256 x 2 B
    assert g.kv_bytes_per_token(2) == 16 * 2 * 2 * 256 * 2 == 32_768
    # 48 x [48/2 heads x 128 x 128 x fp32 + (48*128 + 2*16*128)/2 conv dim x (4 - 1) x bf16]
    assert g.state_bytes(2) == 48 * (24 * 128 * 128 * 4 + 5120 * 3 * 2) == 76_972_032


@pytest.mark.parametrize(
    "name, tp, kv, state",
    [
        ("Qwen3-Next-80B-A3B", 2, 12 * 2 * 1 * 256 * 2, 36 * (16 * 128 * 128 * 4 + 4096 * 3 * 2)),
        ("Qwen3.5-35B-A3B", 2, 10 * 2 * 1 * 256 * 2, 30 * (16 * 128 * 128 * 4 + 4096 * 3 * 2)),
        ("Qwen3.5-27B", 1, 16 * 2 * 4 * 256 * 2, 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2)),
        ("Qwen3.5-27B", 4, 16 * 2 * 1 * 256 * 2, 48 * (12 * 128 * 128 * 4 + 2560 * 3 * 2)),
        # KV heads 2 < TP 4: one head per rank, as SGLang replicates them
        ("Qwen3.5-35B-A3B", 4, 10 * 2 * 1 * 256 * 2, 30 * (8 * 128 * 128 * 4 + 2048 * 3 * 2)),
        ("tiny-qwen35", 2, 2 * 2 * 1 * 64 * 2, 6 * (3 * 32 * 32 * 4 + 160 * 3 * 2)),
        ("tiny-qwen35-text", 1, 1 * 2 * 2 * 64 * 2, 3 * (4 * 32 * 32 * 4 + 256 * 3 * 2)),
        ("tiny-qwen3next", 1, 1 * 2 * 2 * 32 * 2, 3 * (4 * 32 * 32 * 4 + 256 * 3 * 2)),
    ],
)
def test_per_rank_bytes_by_hand(name: str, tp: int, kv: int, state: int) -> None:
    g = _geometry(name)
    assert g.kv_bytes_per_token(tp) == kv
    assert g.state_bytes(tp) == state


def test_equal_to_restore_bench_geometry() -> None:
    """The planner's byte figures are restore_bench's (the benchmark that writes and
    restores them through the real stack) for the same config fields."""
    path = ROOT / "benchmark" / "restore_bench.py"
    spec = importlib.util.spec_from_file_location("restore_bench", path)
    rb = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("restore_bench", rb)
    spec.loader.exec_module(rb)
    for m in rb.MODELS:
        g = _geometry(m.name)
        for tp in (1, 2):
            assert g.kv_bytes_per_token(tp) == m.kv_bytes_per_token(tp), (m.name, tp)
            assert g.state_bytes(tp) == m.state_bytes(tp), (m.name, tp)
    for name in models.names():
        shape = rb.ModelShape.from_config(name, models.load(name)[1].get("text_config", models.load(name)[1]))
        g = _geometry(name)
        assert g.kv_bytes_per_token(2) == shape.kv_bytes_per_token(2), name
        assert g.state_bytes(2) == shape.state_bytes(2), name


def test_parameter_counts_match_the_model_names() -> None:
    """Counted from the configs, the totals land on the published sizes."""
    p27 = weights.count(models.load("Qwen3.5-27B")[1])
    assert 26.5e9 < p27.total < 28.5e9
    nxt = weights.count(models.load("Qwen3-Next-80B-A3B")[1])
    # "A3B": what one token multiplies through, the lm_head (half of `vocab`, untied) included
    assert 79e9 < nxt.total < 82e9 and 2.8e9 < nxt.linear_active + nxt.vocab / 2 < 3.6e9
    moe = weights.count(models.load("Qwen3.5-35B-A3B")[1])
    assert 34e9 < moe.total < 36.5e9 and 2.8e9 < moe.linear_active + moe.vocab / 2 < 3.6e9
    # 27B dense MLP by hand: 64 x 3 x 5120 x 17408
    mlp = 64 * 3 * 5120 * 17408
    assert p27.linear > mlp and p27.linear_active == p27.linear


def test_gptq_4bit_bytes_per_rank_by_hand() -> None:
    p = weights.count(models.load("Qwen3.5-27B")[1])
    expect = p.linear * (4 + 20 / 128) / 8 / 2 + (p.vocab + p.split_other) * 2 / 2 + p.replicated * 2
    assert weights.bytes_per_rank(p, "gptq-4bit", 2) == int(expect)
    assert weights.bytes_per_rank(p, "bf16", 1) == int(p.linear * 2 + (p.vocab + p.split_other) * 2 + p.replicated * 2)


# --- the plan -----------------------------------------------------------------------------


def test_device_pools_by_hand() -> None:
    """Given weights of 8 GiB per rank: the budget, the Mamba slots for one running
    256K context (5 per request + 1 for its tree state), the padding slot, KV in the
    rest, page-aligned."""
    p = make_plan(_inputs(weights_bytes=8 * GiB))
    budget = int(24 * GiB * 0.85) - 8 * GiB
    state, kv = 76_972_032, 32_768
    assert p.device_pool_budget == budget
    # two contexts need 2 x (8 GiB and a page + 6 x state) > budget - state: one fits
    assert (budget - state) // ((262144 + 64) * kv + 6 * state) == 1
    assert p.max_running_requests == 1 and p.device_mamba_slots == 6 == MAMBA_SLOTS_PER_REQUEST + 1
    assert p.device_kv_tokens == (budget - 7 * state) // kv // 64 * 64
    assert p.device_contexts == 1
    assert p.context_kv_bytes == 262144 * kv == 8 * GiB
    assert p.states_per_context == 262144 // 8192 == 32
    assert f"--max-total-tokens {p.device_kv_tokens}" in p.flags
    assert "--max-mamba-cache-size 6" in p.flags and "--max-running-requests 1" in p.flags
    assert (
        "--quantization gptq" in p.flags and "--quantization gptq" not in make_plan(_inputs(tp=4, quant="bf16")).flags
    )


def test_a_context_needs_a_page_beside_its_kv() -> None:
    """A pool of exactly one context's KV tokens is refused: admission charges every request
    a page, so the server would refuse prompts within a page of the context (patch
    prompt-fits-pool). One page more, and it fits."""
    state, kv = 76_972_032, 32_768
    top = int(24 * GiB * 0.85)
    exact = top - (7 * state + 262144 * kv)  # weights leaving KV for the context alone
    with pytest.raises(PlanError, match="--context 262144: .* and a page"):
        make_plan(_inputs(weights_bytes=exact))
    p = make_plan(_inputs(weights_bytes=exact - 64 * kv))
    assert p.device_contexts == 1 and p.device_kv_tokens == 262144 + 64


def test_host_pools_follow_upstreams_ratio_rule() -> None:
    p = make_plan(_inputs(weights_bytes=8 * GiB, host_buffer_tokens=65536))
    r = float(p.hicache_ratio)
    assert p.host_kv_tokens == (int(p.device_kv_tokens * r) // 64 + 1) * 64 >= 65536
    assert p.host_mamba_slots == int(p.device_mamba_slots * r) + 1 >= 4
    assert p.host_bytes == p.host_kv_tokens * 32_768 + p.host_mamba_slots * 76_972_032
    assert p.host_bytes_all_ranks == 2 * p.host_bytes and p.host_contexts == 0


def test_l3_and_restore_by_hand() -> None:
    p = make_plan(_inputs(weights_bytes=8 * GiB, nvme=200 * 10**9, disk_read_gbps=2.0, link_gbps=20.0))
    per_ctx = 2 * (8 * GiB + 32 * 76_972_032)
    assert p.l3_context_bytes == per_ctx and p.l3_contexts == 200 * 10**9 // per_ctx
    read = 8 * GiB + 76_972_032
    assert p.restore_read_bytes == read
    assert p.restore_disk_s == pytest.approx(2 * read / 2e9)
    assert p.restore_h2d_s == pytest.approx(read / 20e9)
    assert p.restore_s == pytest.approx(max(p.restore_disk_s, p.restore_h2d_s))
    q = make_plan(_inputs(weights_bytes=8 * GiB, prefill_tps=2000.0))
    assert q.recompute_s == pytest.approx(262144 / 2000) and q.recompute_source.startswith("given")
    assert "estimate" in p.recompute_source


def test_four_agents_share_the_device_with_l3() -> None:
    p = make_plan(_inputs(weights_bytes=8 * GiB, agents=4))
    assert p.device_contexts == 1 and p.l3_contexts >= 3
    assert any("1 of 4 contexts" in n for n in p.notes)


def test_agent_switch_where_one_context_waits_in_l3() -> None:
    """Issue 50 item 5: 2 agents x 256K, Qwen3.5-27B GPTQ-4bit, TP=2, 2x 24 GB: one context
    fits a rank's device pools, the other waits in L3, so an agent that speaks after the
    other waits for its KV + last checkpoint from the disk (both ranks sharing it), and
    agent_switch.py measured that switch at 1.25x the store's read of the same bytes."""
    from sglang_l3.plan.render import text

    p = make_plan(_inputs(gpu_mem=24 * GiB))
    assert p.device_contexts == 1 and p.agents == 2
    read = 8 * GiB + 76_972_032
    assert p.switch_read_bytes == read == p.restore_read_bytes
    assert p.switch_disk_s == pytest.approx(2 * read / 3e9) == pytest.approx(5.78, abs=0.01)
    assert SWITCH_VS_STORE == 1.25 and p.switch_vs_store == SWITCH_VS_STORE
    assert p.switch_s == pytest.approx(1.25 * 2 * read / 3e9)
    out = text(p)
    assert "\nthe agent switch (1 of 2 contexts on the device: " in out
    assert "\n  switch at disk rate    5.8 s (8.07 GiB per rank at 3 GB/s, 2 rank(s) sharing the disk" in out
    assert "\n  switch measured        7.2 s (5.8 s x 1.25: benchmark/agent_switch.py's" in out
    # a measured disk moves both figures
    q = make_plan(_inputs(gpu_mem=24 * GiB, disk_read_gbps=6.0))
    assert q.switch_disk_s == pytest.approx(2 * read / 6e9) and q.switch_s == pytest.approx(1.25 * 2 * read / 6e9)
    # the constant is the figure docs/state-budget.md reports for 131K
    budget = (ROOT / "docs" / "state-budget.md").read_text()
    assert any(line.startswith("| 131072 |") and f"| {SWITCH_VS_STORE:.2f} (" in line for line in budget.splitlines())


@pytest.mark.parametrize("kw", [dict(context=32768), dict(agents=1), dict(agents=2, context=65536)])
def test_no_agent_switch_when_every_context_stays_on_the_device(kw: dict) -> None:
    from sglang_l3.plan.render import text

    p = make_plan(_inputs(gpu_mem=24 * GiB, **kw))
    assert p.device_contexts >= p.agents
    assert (p.switch_read_bytes, p.switch_disk_s, p.switch_s, p.switch_vs_store) == (None, None, None, None)
    assert "switch" not in text(p)


@pytest.mark.parametrize(
    "kw, setting",
    [
        (dict(weights_bytes=21 * GiB), "--gpu-mem"),
        (dict(context=1 << 20), "--context"),
        (dict(host_ram=16 * GiB), "--host-ram"),
        (dict(nvme=10 * GiB), "--nvme"),
        (dict(host_buffer_tokens=64), "--host-buffer"),
        (dict(tp=3), "--tp"),
        (dict(checkpoint_interval=100), "--checkpoint-interval"),
        (dict(mem_fraction_static=1.2), "--mem-fraction-static"),
        (dict(agents=0), "--agents"),
    ],
)
def test_refuses_plans_that_cannot_work(kw: dict, setting: str) -> None:
    with pytest.raises(PlanError, match=setting):
        make_plan(_inputs(**kw))


def test_constants_are_upstreams() -> None:
    from sglang.srt.mem_cache.allocation_sizing import get_mamba_tracking_slots
    from sglang.srt.mem_cache.kv_cache_configurator import MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO
    from sglang.srt.mem_cache.pool_host.base import HICACHE_HOST_MEMORY_RESERVE_BYTES

    ratio = MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO + get_mamba_tracking_slots(extra_buffer=True, overlap=True)
    assert ratio == MAMBA_SLOTS_PER_REQUEST
    assert HOST_RESERVE_BYTES == HICACHE_HOST_MEMORY_RESERVE_BYTES


# --- the command line -----------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_l3.cli", "plan", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_json_and_text(tmp_path: Path) -> None:
    common = ["--model", "Qwen3.5-27B", "--quant", "gptq-4bit", "--tp", "2", "--gpu-mem", "24GiB"]
    j = _cli(*common, "--json", "--weights-gib", "8")
    assert j.returncode == 0, j.stderr
    out = json.loads(j.stdout)
    assert out["kv_bytes_per_token"] == 32_768 and out["state_bytes"] == 76_972_032
    assert out["weights_bytes"] == 8 * GiB and out["weights_estimated"] is False
    # 2 x 256K (the defaults): one context on the device, the other comes back at each switch
    assert out["switch_read_bytes"] == out["restore_read_bytes"] and out["switch_vs_store"] == 1.25
    assert out["switch_disk_s"] == out["restore_disk_s"]
    assert out["switch_s"] == pytest.approx(1.25 * out["switch_disk_s"])
    fits = json.loads(_cli(*common, "--json", "--weights-gib", "8", "--context", "32K").stdout)
    assert fits["switch_s"] is None and fits["switch_disk_s"] is None and fits["switch_read_bytes"] is None
    t = _cli(*common)
    assert t.returncode == 0 and "76,972,032 B" in t.stdout and "--max-total-tokens" in t.stdout
    # a local config.json is read as the packaged one is
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(models.PUBLISHED["Qwen3.5-27B"]))
    j2 = _cli("--model", str(cfg), "--quant", "gptq-4bit", "--tp", "2", "--json", "--weights-gib", "8")
    assert json.loads(j2.stdout)["device_kv_tokens"] == out["device_kv_tokens"]


def test_cli_refusals_name_the_setting(tmp_path: Path) -> None:
    r = _cli("--model", "Qwen3.5-27B", "--quant", "gptq-4bit", "--tp", "2", "--nvme", "10GiB")
    assert r.returncode == 2 and "--nvme" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--model", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "--model" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"num_hidden_layers": 4}))
    r = _cli("--model", str(bad))
    assert r.returncode == 2 and "hidden_size" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--model", "Qwen3.5-27B", "--gpu-mem", "lots")
    assert r.returncode == 2 and "--gpu-mem" in r.stderr
    r = _cli("--model", "Qwen3.5-27B", "--context", "long")
    assert r.returncode == 2 and "--context" in r.stderr


def test_fp8_kv_is_refused_with_the_reason() -> None:
    """Issue 50: with --kv-dtype fp8 the plan sized the pools for 1-byte KV while its printed
    launch command had no --kv-cache-dtype (the server then gets 2-byte KV in pools sized
    for 1), and fp8 KV has never been through L3 here: refused, saying why."""
    r = _cli("--model", "Qwen3.5-27B", "--quant", "gptq-4bit", "--tp", "2", "--kv-dtype", "fp8")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert "--kv-dtype fp8" in r.stderr and "gfx1100" in r.stderr and "L3" in r.stderr
    j = _cli("--model", "Qwen3.5-27B", "--kv-dtype", "fp8", "--json")
    assert j.returncode == 2 and "fp8" in json.loads(j.stdout)["error"]


def test_printed_launch_command_parses() -> None:
    """Every flag the plan prints is accepted by upstream's parser (with the plugin
    applied: `--hicache-mem-layout buffer_only` is patch cli-buffer-only's)."""
    import argparse
    import shlex

    from sglang.srt.server_args import ServerArgs
    from sglang_l3.plan.render import launch_command

    p = make_plan(_inputs(weights_bytes=8 * GiB))
    argv = shlex.split(launch_command(p, "Qwen/Qwen3.5-27B-GPTQ-Int4").replace("\\\n", " "))[3:]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    assert ns.max_total_tokens == p.device_kv_tokens and ns.max_mamba_cache_size == p.device_mamba_slots
    assert ns.hicache_ratio == float(p.hicache_ratio) and ns.hicache_mem_layout == "buffer_only"
    assert json.loads(ns.hicache_storage_backend_extra_config)["max_bytes"] == p.l3_cap


def test_readme_and_docs_show_what_the_command_prints() -> None:
    """The user's case in README.md and docs/plan.md is the command's real output."""
    args = "--model Qwen3.5-27B --quant gptq-4bit --tp 2 --gpu-mem 24GiB --host-ram 64GiB --agents 2 --context 256K"
    out = _cli(*args.split())
    assert out.returncode == 0, out.stderr
    readme, doc = (ROOT / "README.md").read_text(), (ROOT / "docs" / "plan.md").read_text()
    assert f"$ sglang-l3 plan {args}\n" in readme and f"$ sglang-l3 plan {args}\n" in doc
    assert out.stdout.split("\nlaunch\n")[0].rstrip() in readme
    assert out.stdout in doc


def test_measure_refuses_a_missing_directory(tmp_path: Path) -> None:
    r = _cli("--model", "Qwen3.5-27B", "--measure", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "--measure" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--model", "Qwen3.5-27B", "--measure", str(tmp_path), "--disk-read-gbps", "2")
    assert r.returncode == 2 and "give one" in r.stderr


@pytest.mark.slow
def test_measure_runs_the_stores_benchmark(tmp_path: Path) -> None:
    """--measure takes the read speed our store reached in storage_bench.py on DIR."""
    args = ["--model", "Qwen3.5-27B", "--quant", "gptq-4bit", "--tp", "2", "--json"]
    r = _cli(*args, "--measure", str(tmp_path), "--measure-size", "64MiB")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["disk_read_gbps"] > 0 and out["disk_source"].startswith(f"measured on {tmp_path}")
    assert list(tmp_path.iterdir()) == []  # the benchmark cleaned up after itself
