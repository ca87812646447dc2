"""The Triton fused dequant-GEMM under TRITON_INTERPRET=1, against the torch reference.

Triton's interpreter is a per-process mode (set before triton is imported), and
the AOT compile test needs the compiler in the same pytest process, so every
interpreted computation runs once in a child process (this file run as a
script); the tests below assert on its results, one test per case.
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
K, N = 128, 64  # the combinations: one N tile, four K tiles
KM, NM = 256, 96  # the launch-bucket cases: N=96 > BN=64 exercises the N tail
LAUNCH_MS = (1, 2, 3, 5, 16, 19, 40, 70)  # GEMV 1/2/4 rows, split-K tl.dot, each tl.dot tile
COMBOS = list(itertools.product(BITS, GROUPS, (True, False), ("v1", "v2"), DTYPES))


def combo_id(c) -> str:
    bits, (gs, act), sym, fmt, dt = c
    return f"b{bits}-g{gs}{'-act' if act else ''}-{'sym' if sym else 'asym'}-{fmt}-{dt}"


# --------------------------------------------------------------------------- #
# Child: runs under TRITON_INTERPRET=1, writes JSON
# --------------------------------------------------------------------------- #
def _cmp(c) -> dict[str, Any]:
    return {"ok": c.ok, "rel_l2": c.rel_l2, "max_rel": c.max_rel, "str": str(c)}


def _child(out_path: str) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_gptq_doubles as doubles
    from sglang_l3.quant import dispatch
    from sglang_l3.quant import gptq_ref as R
    from sglang_l3.quant import gptq_triton as T

    assert T.interpreting(), "child must run with TRITON_INTERPRET=1"
    from triton.runtime.interpreter import interpreter_builder

    doubles.register()
    res: dict[str, Any] = {}

    def sanitize(on: bool) -> None:
        # the interpreter's integer-overflow checker doubles its run time: it is
        # kept on for the launch-bucket cases (largest index math), off elsewhere
        interpreter_builder.options = dataclasses.replace(interpreter_builder.options, sanitize_overflow=on)

    def layer(bits, gs, act, sym, fmt, dtype, seed=0, k=K, n=N):
        g = torch.Generator().manual_seed(seed)
        return R.quantize(
            torch.randn(k, n, generator=g) * 0.05,
            bits,
            gs,
            sym=sym,
            act_order=act,
            fmt=fmt,
            scale_dtype=dtype,
            seed=seed,
        )

    # 1. every combination, M=5 (tl.dot split over K), plus the negative controls
    sanitize(False)
    for c in COMBOS:
        bits, (gs, act), sym, fmt, dt = c
        dtype = getattr(torch, dt)
        L = layer(bits, gs, act, sym, fmt, dtype)
        x = R.check_inputs(5, K, dtype, "cpu")
        ref = R.reference_matmul(x, L.qweight, L.qzeros, L.scales, L.g_idx, bits, fmt)
        g = L.g_idx if act else None
        out = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, g, bits, gs, fmt)
        other = "v2" if fmt == "v1" else "v1"
        bad_fmt = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, g, bits, gs, other)
        entry = {
            "good": _cmp(R.compare(out, ref, dtype)),
            "wrong_format": _cmp(R.compare(bad_fmt, ref, dtype)),
            "config": T.pick_config(5, K if gs == -1 else gs, act, K=K, N=N, bits=bits, arch="cpu").name,
        }
        if act:
            no_gidx = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, None, bits, gs, fmt)
            entry["ignored_g_idx"] = _cmp(R.compare(no_gidx, ref, dtype))
        res[combo_id(c)] = entry

    # 2. every M bucket (launch config), including M not a multiple of BM
    sanitize(True)
    for bits, gs, act, dt in ((4, 128, False, "float16"), (3, 64, True, "bfloat16"), (8, -1, False, "float16")):
        dtype = getattr(torch, dt)
        L = layer(bits, gs, act, False, "v2", dtype, seed=3, k=KM, n=NM)
        for m in LAUNCH_MS:
            x = R.check_inputs(m, KM, dtype, "cpu", seed=m)
            ref = R.reference_matmul(x, L.qweight, L.qzeros, L.scales, L.g_idx, bits, "v2")
            out = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, L.g_idx if act else None, bits, gs, "v2")
            res[f"m{m}-b{bits}-g{gs}-{dt}"] = {
                "good": _cmp(R.compare(out, ref, dtype)),
                "config": T.pick_config(m, KM if gs == -1 else gs, act, K=KM, N=NM, bits=bits, arch="cpu").name,
            }
    sanitize(False)

    # 3. dispatcher on CPU (interpreter): Triton is chosen and self-checked
    def select(L, dtype, *, desc_act, declared, dev=None, kernels=None, ck=None, prefix="t"):
        ck = ck or dispatch.Checkpoint(L.qweight, L.qzeros, L.scales, L.g_idx)
        return dispatch.select(
            ck,
            bits=L.bits,
            group_size=L.group_size,
            desc_act=desc_act,
            declared=declared,
            dtype=dtype,
            prefix=prefix,
            dev=dev,
            kernels=kernels,
        )

    def summary(sel, x, want):
        return {
            "kernel": sel.kernel,
            "fmt": sel.fmt,
            "check_ok": sel.check.ok,
            "act_order": sel.act_order,
            "skipped": sel.skipped,
            "out": _cmp(R.compare(sel.gemm(x), want, x.dtype)),
        }

    cpu = dispatch.DeviceInfo("cpu", False, None)
    L = layer(4, 32, True, True, "v2", torch.bfloat16, seed=5)  # act-order, v2 zeros declared v1
    x = R.check_inputs(7, K, torch.bfloat16, "cpu", seed=9)
    res["dispatch_default"] = summary(
        select(L, torch.bfloat16, desc_act=True, declared="v1", dev=cpu), x, x.float() @ L.w
    )

    # row-parallel act-order shard: full scales/zeros, the shard's rows, global group ids
    L = layer(4, 32, True, False, "v1", torch.float16, seed=6)
    lo, hi = K // 2, K
    q_shard = R.pack_rows(L.q[lo:hi], 4)
    ck = dispatch.Checkpoint(q_shard, L.qzeros, L.scales, L.g_idx[lo:hi].contiguous())
    x = R.check_inputs(3, hi - lo, torch.float16, "cpu", seed=4)
    sel = select(L, torch.float16, desc_act=True, declared="v1", dev=cpu, ck=ck)
    res["dispatch_row_shard"] = summary(sel, x, x.float() @ L.w[lo:hi])

    # 4. a never-run native kernel that returns garbage is caught; Triton takes over
    gfx = dispatch.DeviceInfo("cpu", True, "gfx1100")
    found = dispatch.discover(namespaces_first=[doubles.RDNA3_NO_SHUFFLE])
    L = layer(4, 64, False, True, "v1", torch.float16, seed=7)
    x = R.check_inputs(5, K, torch.float16, "cpu", seed=2)
    sel = select(
        L,
        torch.float16,
        desc_act=False,
        declared="v1",
        dev=gfx,
        kernels=[dispatch.NativeRdna3Kernel(*found.rdna3[0]), dispatch.TritonKernel(), dispatch.TorchKernel()],
    )
    res["dispatch_broken_native"] = summary(sel, x, x.float() @ L.w)

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

    return run_child(__file__, str(tmp_path_factory.mktemp("gptq_interp") / "results.json"))


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_triton_matches_reference_within_rounding(interp, combo) -> None:
    r = interp[combo_id(combo)]
    assert r["good"]["ok"], r


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_negative_controls_are_caught(interp, combo) -> None:
    """Same kernel, same comparison: the wrong zero format and (act-order) an
    ignored g_idx must fail it."""
    r = interp[combo_id(combo)]
    assert not r["wrong_format"]["ok"], r["wrong_format"]
    if combo[1][1]:
        assert not r["ignored_g_idx"]["ok"], r["ignored_g_idx"]


@pytest.mark.parametrize("m", LAUNCH_MS)
@pytest.mark.parametrize("layer", ("b4-g128-float16", "b3-g64-bfloat16", "b8-g-1-float16"))
def test_every_launch_bucket(interp, m, layer) -> None:
    r = interp[f"m{m}-{layer}"]
    assert r["good"]["ok"], r
    kind = r["config"].split("-")[0]
    assert kind == ("gemv" if m <= 4 else "dot"), r["config"]
    assert ("-split" in r["config"]) == (m <= 16), r["config"]  # this layer's K splits on the CPU table


def test_dispatch_picks_triton_and_fixes_misdeclared_v2(interp) -> None:
    r = interp["dispatch_default"]
    assert r["kernel"] == "triton" and r["check_ok"] and r["out"]["ok"], r
    assert r["fmt"] == "v2" and r["act_order"]
    assert r["skipped"] == [], "no native op and no sgl_kernel on this machine: Triton is first"


def test_dispatch_row_parallel_act_order_shard(interp) -> None:
    r = interp["dispatch_row_shard"]
    assert r["kernel"] == "triton" and r["out"]["ok"] and r["act_order"], r


def test_garbage_native_kernel_falls_back_loudly(interp) -> None:
    r = interp["dispatch_broken_native"]
    assert r["kernel"] == "triton" and r["out"]["ok"], r
    ((name, why),) = r["skipped"]
    assert name.startswith("native:sglang_l3_test_broken::gptq_gemm_rdna3")
    assert why.startswith("self-check mismatch"), why
