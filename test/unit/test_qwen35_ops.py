"""The Qwen3.5 CPU ports (patch cpu-qwen35-ops, sglang_l3.cpu_serving.ops) against
upstream's own Triton kernels run by Triton's interpreter, on random inputs.

- `fused_qkvzba_split_reshape_cat_contiguous`: bit-exact (a copy), value/key head
  ratios 1, 2, 3 (the 27B's, non-power-of-two) and 4, a row stride wider than the row.
- `fla.layernorm_gated.RMSNorm.forward` (`rms_norm_gated`, is_rms_norm): every
  option the module has (swish/silu/sigmoid gate, before/after the norm, groups,
  bias, a 3-D gate), fp32 / bf16 / fp16.
- `elementwise.fused_sigmoid_mul`: flat and 3-D strided gates, in place or not.

Tolerances (the kernels reduce and exponentiate in fp32 like the ports, but not in
the same order): fp32 outputs within 1e-6 absolute + 1e-6 relative (a few ulp); fp16/bf16 outputs
within one ulp of their dtype, with at most 1% of the elements off by that ulp (an
fp32 difference of an ulp that crosses a rounding boundary). One interpreter
artifact is allowed for: it stores fp32 into bf16 by truncation, while a GPU rounds
to nearest-even, so a bf16 case's reference is the kernel's fp32 output (same
inputs, upcast exactly) rounded to nearest — the same value a GPU stores. The
interpreter is a per-process mode, so the kernels run once in a child process (this
file as a script) and the tests assert on its JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch
from sglang_l3.cpu_serving import ops

DTYPES = ("float32", "bfloat16", "float16")
NORM_CASES = [  # (activation, norm_before_gate, group_size, bias)
    ("swish", True, None, False),  # Qwen3.5's GDN output norm
    ("silu", True, None, True),
    ("sigmoid", True, None, False),
    ("swish", False, None, False),
    ("swish", True, 16, False),
    ("sigmoid", False, 16, True),
]
RATIOS = (1, 2, 3, 4)


def norm_id(c) -> str:
    act, before, gs, bias = c
    return f"{act}-{'before' if before else 'after'}-g{gs}{'-bias' if bias else ''}"


# --------------------------------------------------------------------------- #
# Child: upstream's Triton kernels under TRITON_INTERPRET=1
# --------------------------------------------------------------------------- #
def _compare(ref: torch.Tensor, got: torch.Tensor) -> dict[str, Any]:
    assert ref.shape == got.shape and ref.dtype == got.dtype, (ref.shape, got.shape, ref.dtype, got.dtype)
    diff = (ref.double() - got.double()).abs()
    ulp = torch.finfo(ref.dtype).eps * ref.double().abs().clamp_min(torch.finfo(ref.dtype).tiny)
    return {
        "dtype": str(ref.dtype).removeprefix("torch."),
        "equal": bool(torch.equal(ref, got)),
        "max_abs": float(diff.max()),
        "close": bool((diff <= 1e-6 + 1e-6 * ref.double().abs()).all()),
        "within_ulp": bool((diff <= ulp * 1.0001).all()),
        "frac_off": float((diff > 0).double().mean()),
        "numel": ref.numel(),
    }


def _child(out_path: str) -> None:
    import contextlib

    from sglang.kernels.ops.attention import triton_gdn_fused_proj as split_k
    from sglang.kernels.ops.attention.fla import layernorm_gated as norm_k
    from sglang.kernels.ops.elementwise import elementwise as gate_k

    # the launch wrapper asks CUDA for the SM count and a device context: neither
    # changes what the kernel computes (rows per block only tiles the grid)
    norm_k._get_sm_count = lambda device: 8
    norm_k.device_context = lambda device: contextlib.nullcontext()

    def as_gpu_stores(fn, *tensors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # bf16: run in fp32 (inputs upcast exactly), round to nearest like a GPU store
        if dtype == torch.bfloat16:
            return fn(*(t.float() if t.is_floating_point() else t for t in tensors)).to(dtype)
        return fn(*tensors)

    gen = torch.Generator().manual_seed(23)
    res: dict[str, Any] = {}

    # split: nqk=2 key heads, head dims 32/16, T=9 tokens; a row stride 5 wider
    for r in RATIOS:
        nqk, nv, hqk, hv, T = 2, 2 * r, 32, 16, 9
        width = 2 * nqk * hqk + 2 * nv * hv
        qkvz = torch.randn(T, width + 5, generator=gen).bfloat16()[:, :width]
        ba = torch.randn(T, 2 * nv, generator=gen).bfloat16()
        ref = split_k.fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, nqk, nv, hqk, hv)
        got = ops.fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, nqk, nv, hqk, hv)
        res[f"split-r{r}"] = [_compare(a, b) for a, b in zip(ref, got, strict=True)]
        # Qwen3-Next's port reads a per-group interleave: wrong on this layout
        wrong = ops.fused_qkvzba_split_reshape_cat(qkvz.contiguous(), ba, nqk, nv, hqk, hv)
        res[f"split-r{r}-interleaved-port"] = [bool(torch.equal(a, b)) for a, b in zip(ref, wrong, strict=True)]

    for dt_name in DTYPES:
        dt = getattr(torch, dt_name)
        for case in NORM_CASES:
            act, before, gs, bias = case
            x = (torch.randn(37, 64, generator=gen) * 3).to(dt)
            z = (torch.randn(37, 64, generator=gen) * 2).to(dt)
            w = torch.randn(64, generator=gen).to(dt)
            b = torch.randn(64, generator=gen).to(dt) if bias else None

            def kernel(x, z, w, *b, act=act, before=before, gs=gs):
                return norm_k.rms_norm_gated(
                    x=x,
                    weight=w,
                    bias=b[0] if b else None,
                    z=z,
                    eps=1e-6,
                    group_size=gs,
                    norm_before_gate=before,
                    is_rms_norm=True,
                    activation=act,
                )

            ref = as_gpu_stores(kernel, x, z, w, *([b] if bias else []), dtype=dt)
            got = ops.layernorm_gated_rms(x, w, b, z, 1e-6, gs, before, act)
            res[f"norm-{norm_id(case)}-{dt_name}"] = _compare(ref, got)
        # the 3-D gate: x [T*H, N], z [T, H, N] (a strided view)
        x = torch.randn(4 * 3, 32, generator=gen).to(dt)
        z = torch.randn(4, 3, 64, generator=gen).to(dt)[..., 16:48]
        w = torch.randn(32, generator=gen).to(dt)

        def kernel3(x, z, w):
            return norm_k.rms_norm_gated(x=x, weight=w, bias=None, z=z, eps=1e-6, is_rms_norm=True)

        res[f"norm-3d-gate-{dt_name}"] = _compare(
            as_gpu_stores(kernel3, x, z, w, dtype=dt), ops.layernorm_gated_rms(x, w, None, z, 1e-6)
        )
        # the module itself (what the patch replaces), on a no-z call too
        mod = norm_k.RMSNorm(64, eps=1e-6, norm_before_gate=True, dtype=dt)
        with torch.no_grad():
            mod.weight.copy_(torch.randn(64, generator=gen))
        x = torch.randn(5, 64, generator=gen).to(dt)
        res[f"norm-module-no-gate-{dt_name}"] = _compare(
            as_gpu_stores(
                lambda x, w: norm_k.rms_norm_gated(x=x, weight=w, bias=None, is_rms_norm=True), x, mod.weight, dtype=dt
            ),
            ops.layernorm_gated_rms(
                x, mod.weight, None, None, mod.eps, mod.group_size, mod.norm_before_gate, mod.activation
            ),
        )

        # gate: Qwen3.5's [T, H, 2D] q|gate split leaves gate a strided [T, H, D] view
        T, H, D = 11, 6, 64
        attn = torch.randn(T, H * D, generator=gen).to(dt)
        q_gate = (torch.randn(T, H, 2 * D, generator=gen) * 4).to(dt)
        gate3 = torch.chunk(q_gate, 2, dim=-1)[1]
        ref = as_gpu_stores(lambda a, g: gate_k.fused_sigmoid_mul(a.clone(), g), attn, gate3, dtype=dt)
        got = ops.fused_sigmoid_mul(attn.clone(), gate3)
        res[f"gate-3d-{dt_name}"] = _compare(ref, got)
        flat = (torch.randn(T, H * D, generator=gen) * 4).to(dt)
        ref = as_gpu_stores(lambda a, g: gate_k.fused_sigmoid_mul(a.clone(), g), attn, flat, dtype=dt)
        out = attn.clone()
        ret = ops.fused_sigmoid_mul(out, flat, inplace=True)
        res[f"gate-flat-inplace-{dt_name}"] = {**_compare(ref, out), "same_storage": ret.data_ptr() == out.data_ptr()}

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

    return run_child(__file__, str(tmp_path_factory.mktemp("qwen35_interp") / "results.json"))


def _within_tolerance(c: dict[str, Any]) -> None:
    if c["dtype"] == "float32":
        assert c["close"], c
    else:
        assert c["within_ulp"] and c["frac_off"] <= 0.01, c


@pytest.mark.parametrize("ratio", RATIOS)
def test_contiguous_split_is_bit_exact(interp, ratio) -> None:
    for c in interp[f"split-r{ratio}"]:
        assert c["equal"], c


@pytest.mark.parametrize("ratio", RATIOS)
def test_qwen3next_split_is_wrong_on_the_contiguous_layout(interp, ratio) -> None:
    """Why the patch has its own split: the interleaved port gives another answer
    (a single key-head group, ratio 1 with nqk=1, would coincide; nqk=2 here)."""
    assert not all(interp[f"split-r{ratio}-interleaved-port"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", NORM_CASES, ids=norm_id)
def test_gated_rms_norm_matches_the_kernel(interp, case, dtype) -> None:
    _within_tolerance(interp[f"norm-{norm_id(case)}-{dtype}"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_3d_gate_and_no_gate(interp, dtype) -> None:
    _within_tolerance(interp[f"norm-3d-gate-{dtype}"])
    _within_tolerance(interp[f"norm-module-no-gate-{dtype}"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_matches_the_kernel(interp, dtype) -> None:
    _within_tolerance(interp[f"gate-3d-{dtype}"])
    c = interp[f"gate-flat-inplace-{dtype}"]
    _within_tolerance(c)
    assert c["same_storage"], "inplace=True must write into attn_output"


# --------------------------------------------------------------------------- #
# in-process: upstream's torch reference and the shape contract
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("group_size", (None, 8))
@pytest.mark.parametrize("before", (True, False))
def test_gated_rms_norm_matches_upstream_torch_reference(group_size, before) -> None:
    from sglang.kernels.ops.attention.fla.layernorm_gated import rms_norm_ref

    gen = torch.Generator().manual_seed(5)
    x, z = torch.randn(2, 7, 32, generator=gen), torch.randn(2, 7, 32, generator=gen)
    w, b = torch.randn(32, generator=gen), torch.randn(32, generator=gen)
    ref = rms_norm_ref(x, w, b, z=z, eps=1e-6, group_size=group_size, norm_before_gate=before)
    got = ops.layernorm_gated_rms(x, w, b, z, 1e-6, group_size, before, "swish")
    assert got.shape == x.shape
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_clear_errors() -> None:
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="gate shape"):
        ops.layernorm_gated_rms(x, torch.ones(8), None, torch.zeros(4, 9))
    with pytest.raises(ValueError, match="group size"):
        ops.layernorm_gated_rms(x, torch.ones(8), None, None, group_size=3)
    with pytest.raises(ValueError, match="same shape"):
        ops.fused_sigmoid_mul(x, torch.zeros(4, 9))
    with pytest.raises(NotImplementedError, match="FP8"):
        ops.fused_sigmoid_mul(x, x, quant=True)
