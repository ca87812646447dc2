"""test/gpu/device_check.sh --dry-run: the GPU machine's script, its logic checked
here (environment report, the GPTQ check harness and the benchmark with every new
Triton kernel and table config run by the Triton interpreter on the CPU,
benchmark arguments, the cache steps of test/gpu/cache_check.sh on the CPU stack
(restore_bench and agent_switch included), results under $OUT), without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, SITE=str(tmp_path / "site"))
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        ["bash", "test/gpu/device_check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "gptq_check: all match" in log and "dry run: logic checked" in log
    assert "--ms" not in log  # the command ran, it was not just echoed
    names = ("device_check.log", "env.txt", "gptq_check.json", "gptq_bench.txt", "gptq_bench.json", "cache_check.log")
    for name in names:
        assert (tmp_path / name).is_file(), name
    # what comes back from the GPU machine: at most 8 files, no folders
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "site") == sorted(names)

    # 5. the cache steps, on the CPU stack: doctor, the selection and the fence control
    # collected, restore_bench through the stack's device switch, every row exact
    cache = (tmp_path / "cache_check.log").read_text()
    assert "cache steps: all passed" in log
    assert "doctor: all good" in cache and "tree core" in cache
    assert cache.count("tests collected") == 1 and "restore_bench: done" in cache
    assert "fence control collected: test/integration/test_streamed_restore_async.py::" in cache
    # 6. agent_switch through the same device switch: both switches exact, both turns in L3
    assert "agent_switch.py --device cpu --context 1024" in cache and "agent_switch: done" in cache
    assert "a_pages_in_l3=yes exact=yes switches=2 context=1024" in cache
    assert "device cpu (the CPU stand-in" in cache and "True" in cache.split("restore_vs_store=")[0].splitlines()[-1]
    assert "sglang pin (not needed here)" in (tmp_path / "env.txt").read_text()

    # 1. the kernels, interpreted: every case matched, every table's decode configs ran
    check = json.loads((tmp_path / "gptq_check.json").read_text())
    assert check["device"] == "cpu" and check["failed"] == 0 and check["done"] == check["cases"] > 0
    assert check["complete"]
    assert {r["config"].split("-")[0] for r in check["rows"] if not r["case"].startswith("table")} == {"gemv", "dot"}
    for table in check["tables"]:
        names = [c.split(":", 1)[1] for c in check["table_configs"] if c.startswith(f"{table}:")]
        for shape in ("gemv-BM1-", "gemv-BM2-", "gemv-BM4-", "dot-BM16-"):
            assert any(n.startswith(shape) and "-split2-" in n for n in names), (table, shape, names)
            assert any(n.startswith(shape) and "-split" not in n for n in names), (table, shape, names)
    assert {"sm90", "gfx1100", "default", "cpu"} <= set(check["tables"])

    # 2. the benchmark: old and new Triton side by side on every shape, the model's layers included
    bench = json.loads((tmp_path / "gptq_bench.json").read_text())
    rows = bench["rows"]
    shapes = {r["shape"] for r in rows}
    assert {"K=N=4096", "K=N=8192"} <= shapes
    model = {s.split(" ", 1)[1] for s in shapes if s.startswith("Qwen3.5-27B/tp2 ")}
    assert model == {
        "attn.qkv_proj",
        "attn.o_proj",
        "mlp.gate_up_proj",
        "mlp.down_proj",
        "gdn.in_proj_qkvz",
        "gdn.in_proj_ba",
        "gdn.out_proj",
    }
    for shape in shapes:
        kernels = {r["kernel"]: r for r in rows if r["shape"] == shape and r["m"] == 1}
        assert kernels["triton-old (tl.dot, no split-K)"]["check"].startswith("ok"), kernels
        assert kernels["triton"]["check"].startswith("ok") and kernels["triton"]["config"].startswith("gemv-BM1")
        assert "dense fp16 matmul" in kernels
    assert bench["sweep"] and all(r["check"].startswith("ok") for r in bench["sweep"])
    text = (tmp_path / "gptq_bench.txt").read_text()
    assert "| shape | K | N | M | dense fp16 µs | Triton old µs | old / dense | Triton new µs | new / dense |" in text
    assert "| K=N=8192 | 256 | 256 | 16 |" in text  # the table's rows (the dry run scales shapes 32x down)


def test_model_shapes_are_the_planner_config() -> None:
    """Qwen3.5-27B at TP=2, per rank, from the packaged config (hidden 5120, MLP 17408,
    24 x 256 attention heads with an output gate, 4 KV heads, GDN 16 x 128 keys and
    48 x 128 values)."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import gptq_bench

    shapes = {name: (k, n, count) for name, k, n, count in gptq_bench.model_shapes("Qwen3.5-27B", 2)}
    assert shapes == {
        "attn.qkv_proj": (5120, 6144 + 2 * 512, 16),
        "attn.o_proj": (3072, 5120, 16),
        "mlp.gate_up_proj": (5120, 17408, 64),
        "mlp.down_proj": (8704, 5120, 64),
        "gdn.in_proj_qkvz": (5120, 2 * 1024 + 2 * 3072, 48),
        "gdn.in_proj_ba": (5120, 48, 48),
        "gdn.out_proj": (3072, 5120, 48),
    }
