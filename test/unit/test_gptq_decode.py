"""The decode path of the Triton GPTQ kernels (issue 53) under TRITON_INTERPRET=1:
the GEMV kernel (M <= 4) and tl.dot split over K (M <= 16), with the two-pass
reduction, against the fp32 torch reference.

Covered: every bit width (2/3/4/8), zero format (v1/v2), symmetric and
asymmetric zeros, group layout (grouped, act-order g_idx, channel-wise) and
activation dtype (fp16/bf16) through the GEMV kernel, each with its wrong-format
negative control; every decode config of every architecture table
(gptq_triton.ARCH_TABLES) forced onto small layers; the split-K result is
bit-identical run to run. Shapes are small (the interpreter runs each program
in numpy); as in test_gptq_triton.py, everything interpreted runs once in a
child process and the tests assert on its JSON.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from typing import Any

import pytest

BITS = (2, 3, 4, 8)
GROUPS = ((32, False), (64, True), (-1, False))  # (group_size, act_order)
DTYPES = ("float16", "bfloat16")
K, N = 128, 64
COMBOS = list(itertools.product(BITS, GROUPS, (True, False), ("v1", "v2"), DTYPES))
KT, NT = 256, 96  # the table configs: N=96 leaves a partial N tile for BN=64
# (bits, group, act_order, symmetric, zero format, dtype) the table configs run on
TABLE_LAYERS = (
    (4, 128, False, True, "v1", "float16"),
    (4, 64, True, False, "v2", "bfloat16"),
    (3, 64, False, False, "v1", "float16"),
    (2, -1, False, True, "v2", "bfloat16"),
    (8, 32, False, False, "v2", "float16"),
)


def combo_id(c) -> str:
    bits, (gs, act), sym, fmt, dt = c
    return f"b{bits}-g{gs}{'-act' if act else ''}-{'sym' if sym else 'asym'}-{fmt}-{dt}"


def layer_id(spec) -> str:
    bits, gs, act, sym, fmt, dt = spec
    return f"b{bits}-g{gs}{'-act' if act else ''}-{'sym' if sym else 'asym'}-{fmt}-{dt}"


def _arch_tables() -> list[str]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    from sglang_l3.quant.gptq_triton import ARCH_TABLES

    return sorted(ARCH_TABLES)


# --------------------------------------------------------------------------- #
# Child: runs under TRITON_INTERPRET=1, writes JSON
# --------------------------------------------------------------------------- #
def _cmp(c) -> dict[str, Any]:
    return {"ok": c.ok, "rel_l2": c.rel_l2, "max_rel": c.max_rel, "str": str(c)}


def _child(out_path: str) -> None:
    import torch
    from sglang_l3.quant import gptq_ref as R
    from sglang_l3.quant import gptq_triton as T
    from triton.runtime.interpreter import interpreter_builder

    assert T.interpreting(), "child must run with TRITON_INTERPRET=1"
    res: dict[str, Any] = {}

    def sanitize(on: bool) -> None:  # the overflow checker doubles the run time
        interpreter_builder.options = dataclasses.replace(interpreter_builder.options, sanitize_overflow=on)

    def layer(bits, gs, act, sym, fmt, dtype, seed=0, k=K, n=N):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(k, n, generator=g) * 0.05
        return R.quantize(w, bits, gs, sym=sym, act_order=act, fmt=fmt, scale_dtype=dtype, seed=seed)

    # 1. every combination through the GEMV kernel, M=3 (4 rows held, one masked)
    sanitize(False)
    for c in COMBOS:
        bits, (gs, act), sym, fmt, dt = c
        dtype = getattr(torch, dt)
        L = layer(bits, gs, act, sym, fmt, dtype)
        x = R.check_inputs(3, K, dtype, "cpu")
        ref = R.reference_matmul(x, L.qweight, L.qzeros, L.scales, L.g_idx, bits, fmt)
        g = L.g_idx if act else None
        cfg = T.pick_config(3, K if gs == -1 else gs, act, K=K, N=N, bits=bits, arch="cpu")
        out = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, g, bits, gs, fmt, config=cfg)
        other = "v2" if fmt == "v1" else "v1"
        bad = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, g, bits, gs, other, config=cfg)
        entry = {"good": _cmp(R.compare(out, ref, dtype)), "wrong_format": _cmp(R.compare(bad, ref, dtype))}
        entry["config"] = cfg.name
        if act:
            no_gidx = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, None, bits, gs, fmt, config=cfg)
            entry["ignored_g_idx"] = _cmp(R.compare(no_gidx, ref, dtype))
        res[combo_id(c)] = entry

    # 2. every decode config of every architecture table, split over K in 2 (the
    # overflow checker on for the first layer)
    for spec in TABLE_LAYERS:
        sanitize(spec == TABLE_LAYERS[0])
        bits, gs, act, sym, fmt, dt = spec
        dtype = getattr(torch, dt)
        L = layer(bits, gs, act, sym, fmt, dtype, seed=bits, k=KT, n=NT)
        g = L.g_idx if act else None
        for arch in T.ARCH_TABLES:
            for m, cfg in T.table_configs(arch, bits, KT if gs == -1 else gs):
                if act:  # what pick_config does for a g_idx layer: per-row groups
                    cfg = dataclasses.replace(cfg, tile_group=False)
                x = R.check_inputs(m, KT, dtype, "cpu", seed=m)
                out = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, g, bits, gs, fmt, config=cfg)
                res[f"table-{arch}-m{m}-{layer_id(spec)}"] = {
                    "good": _cmp(R.compare(out, x.float() @ L.w, dtype)),
                    "config": cfg.name,
                }
    sanitize(False)

    # 3. the split-K result is bit-stable, and agrees with the unsplit launch
    L = layer(4, 32, False, False, "v1", torch.float16, seed=11, k=KT, n=NT)
    for m in (1, 8):
        x = R.check_inputs(m, KT, torch.float16, "cpu", seed=3)
        cfg = T.pick_config(m, 32, False, K=KT, N=NT, bits=4, arch="cpu")
        runs = [T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, None, 4, 32, "v1", config=cfg) for _ in range(2)]
        whole = T.gptq_gemm(
            x, L.qweight, L.qzeros, L.scales, None, 4, 32, "v1", config=dataclasses.replace(cfg, split_k=1)
        )
        res[f"stable-m{m}"] = {
            "config": cfg.name,
            "identical": bool(torch.equal(runs[0], runs[1])),
            "vs_unsplit": _cmp(R.compare(runs[0], whole.float(), torch.float16)),
            "good": _cmp(R.compare(runs[0], x.float() @ L.w, torch.float16)),
        }

    # 4. the kernel before issue 53 (benchmark/gptq_bench.py's "old") at M = 1
    x = R.check_inputs(1, KT, torch.float16, "cpu", seed=4)
    old = T.legacy_config(1, 32, False)
    out = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, None, 4, 32, "v1", config=old)
    res["legacy-m1"] = {"config": old.name, "good": _cmp(R.compare(out, x.float() @ L.w, torch.float16))}

    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    _child(sys.argv[1])
    sys.exit(0)


# --------------------------------------------------------------------------- #
# Parent: pytest
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def interp(tmp_path_factory) -> dict[str, Any]:
    from triton_interp import run_child

    return run_child(__file__, str(tmp_path_factory.mktemp("gptq_decode") / "results.json"))


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_gemv_matches_reference_and_catches_wrong_format(interp, combo) -> None:
    r = interp[combo_id(combo)]
    assert r["config"].startswith("gemv-BM4-") and "-split" in r["config"], r["config"]
    assert r["good"]["ok"], r
    assert not r["wrong_format"]["ok"], r["wrong_format"]
    if combo[1][1]:
        assert not r["ignored_g_idx"]["ok"], r["ignored_g_idx"]


@pytest.mark.parametrize("spec", TABLE_LAYERS, ids=layer_id)
@pytest.mark.parametrize("arch", _arch_tables())
def test_every_table_config_matches_reference(interp, arch, spec) -> None:
    rows = {k: v for k, v in interp.items() if k.startswith(f"table-{arch}-") and k.endswith(layer_id(spec))}
    kinds = {v["config"].split("-")[0] for v in rows.values()}
    assert kinds == {"gemv", "dot"}, rows.keys()
    bms = {v["config"].split("-")[1] for v in rows.values() if v["config"].startswith("gemv")}
    assert bms == {"BM1", "BM2", "BM4"}, rows.keys()
    for name, r in rows.items():
        assert "-split2-" in r["config"], name
        assert r["good"]["ok"], (name, r)


@pytest.mark.parametrize("m", (1, 8))
def test_split_k_is_bit_stable(interp, m) -> None:
    r = interp[f"stable-m{m}"]
    assert "-split" in r["config"], r["config"]
    assert r["identical"], "two runs of the same split-K launch differ"
    assert r["vs_unsplit"]["ok"] and r["good"]["ok"], r


def test_legacy_kernel_still_matches(interp) -> None:
    r = interp["legacy-m1"]
    assert r["config"] == "dot-BM16-BN64-BK32-w4-tile" and r["good"]["ok"], r


@pytest.mark.parametrize("arch", _arch_tables())
def test_self_check_runs_every_launch_shape(arch) -> None:
    """dispatch.CHECK_MS reaches every kernel / tile the dispatcher can pick by M,
    on every architecture's table (M up to 300; larger M repeats the last tile)."""
    from sglang_l3.quant import dispatch
    from sglang_l3.quant import gptq_triton as T

    def shape(m: int) -> tuple:
        c = T.pick_config(m, 128, False, K=4096, N=4096, bits=4, arch=arch)
        return (c.kind, c.BM, c.BN, c.BK, c.num_warps, c.split_k > 1)

    assert {shape(m) for m in dispatch.CHECK_MS} == {shape(m) for m in range(1, 301)}
