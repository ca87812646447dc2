"""Kernel dispatch: native-op discovery and schema probing, eligibility, weight
preparation (sort, shuffle, zero format), the load-time self-check and its loud
fallback, and the doctor's table. Native GPU ops are CPU doubles
(test_gptq_doubles.py); everything else is the real code path."""

from __future__ import annotations

import logging

import pytest
import test_gptq_doubles as doubles
import torch
from sglang_l3.quant import dispatch
from sglang_l3.quant import gptq_ref as R

doubles.register()
GFX1100 = dispatch.DeviceInfo("cpu", True, "gfx1100")  # simulated: tensors stay on CPU
K, N = 256, 64


def _layer(bits=4, gs=64, act=False, sym=True, fmt="v1", dtype=torch.float16, seed=0, k=K, n=N):
    g = torch.Generator().manual_seed(seed)
    return R.quantize(
        torch.randn(k, n, generator=g) * 0.05, bits, gs, sym=sym, act_order=act, fmt=fmt, scale_dtype=dtype, seed=seed
    )


def _select(L, dtype, *, declared="v1", desc_act=None, dev=GFX1100, kernels=None, prefix="model.t"):
    ck = dispatch.Checkpoint(L.qweight, L.qzeros, L.scales, L.g_idx)
    return dispatch.select(
        ck,
        bits=L.bits,
        group_size=L.group_size,
        desc_act=bool(L.g_idx is not None and not R.is_sequential(L.g_idx, L.group_size if L.group_size > 0 else L.K))
        if desc_act is None
        else desc_act,
        declared=declared,
        dtype=dtype,
        prefix=prefix,
        dev=dev,
        kernels=kernels,
    )


def _native(ns):
    found = dispatch.discover(namespaces_first=[ns])
    return [dispatch.NativeRdna3Kernel(*found.rdna3[0]), dispatch.TritonKernel(), dispatch.TorchKernel()]


def _assert_matches(sel, L, dtype, m=6):
    x = R.check_inputs(m, L.K, dtype, "cpu", seed=77)
    c = R.compare(sel.gemm(x), x.float() @ L.w, dtype)
    assert c.ok, c


# --------------------------------------------------------------------------- #
# Discovery and schema probing
# --------------------------------------------------------------------------- #
def test_schema_probe_maps_both_known_signatures_and_refuses_unknown() -> None:
    new, why = dispatch.probe_schema("t::new", dispatch.lookup_op(doubles.RDNA3_V2FLAG, "gptq_gemm_rdna3"))
    assert why is None and new.takes_v2
    assert [r for _, r in new.roles] == ["x", "qweight", "qzeros", "scales", "g_idx", "use_v2"]
    old, why = dispatch.probe_schema("t::old", dispatch.lookup_op(doubles.RDNA3_OLD, "gptq_gemm_rdna3"))
    assert why is None and not old.takes_v2
    assert [r for _, r in old.roles] == ["x", "qweight", "qzeros", "scales", "g_idx", "shuffle", "bits"]
    bad, why = dispatch.probe_schema("t::bad", dispatch.lookup_op(doubles.RDNA3_UNKNOWN_ARG, "gptq_gemm_rdna3"))
    assert bad is None and "split_k" in why
    found = dispatch.discover(namespaces_first=[doubles.RDNA3_UNKNOWN_ARG])
    assert not found.rdna3 and any("split_k" in n for n in found.notes)


def test_discovery_without_native_ops_degrades_to_triton_and_torch() -> None:
    found = dispatch.discover()
    names = [k.name for k in dispatch.candidates(found)]
    if not found.rdna3 and found.sgl_gemm is None:  # this CPU machine
        assert names == ["triton", "torch-reference"]
        assert any("no gptq_gemm_rdna3" in n for n in found.notes)


def test_user_library_that_cannot_load_is_reported(monkeypatch) -> None:
    monkeypatch.setenv(dispatch.ENV_OPS, "/nonexistent/libgptq.so")
    found = dispatch.discover()
    assert any(n.startswith("could not load /nonexistent/libgptq.so") for n in found.notes)
    monkeypatch.setenv(dispatch.ENV_NATIVE, "0")
    found = dispatch.discover()
    assert not found.rdna3 and any("not probed" in n for n in found.notes)


# --------------------------------------------------------------------------- #
# Native RDNA3 op
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
@pytest.mark.parametrize("stored", ("v1", "v2"))
@pytest.mark.parametrize("ns", (doubles.RDNA3_V2FLAG, doubles.RDNA3_OLD))
def test_native_rdna3_serves_4bit_symmetric_on_gfx1100(ns, stored, dtype) -> None:
    """Weights reach the op ExLlama-shuffled, zeros in the format its schema implies
    (v2 zeros re-encoded for the flag-less signature), and the result is right;
    the checkpoint claims v1 in every case."""
    L = _layer(fmt=stored, dtype=dtype, seed=1)
    before = doubles.CALLS.get(ns, 0)
    sel = _select(L, dtype, kernels=_native(ns))
    assert sel.kernel == f"native:{ns}::gptq_gemm_rdna3" and sel.check.ok, sel.skipped
    assert sel.fmt == stored and sel.skipped == []
    assert doubles.CALLS[ns] - before == len(dispatch.CHECK_MS)  # the self-check ran every M through the op
    assert torch.equal(sel.tensors["qweight"], R.exllama_shuffle_4bit(L.qweight))
    _assert_matches(sel, L, dtype)


def test_native_rdna3_act_order_is_sorted_once_at_load() -> None:
    L = _layer(act=True, seed=2)
    sel = _select(L, torch.float16, kernels=_native(doubles.RDNA3_V2FLAG))
    assert sel.kernel.startswith("native:") and sel.act_order
    assert sel.gemm.perm is not None
    _assert_matches(sel, L, torch.float16)


@pytest.mark.parametrize(
    "case,reason",
    [
        (dict(bits=3, gs=64), "3-bit (4-bit only)"),
        (dict(bits=8, gs=64), "8-bit (4-bit only)"),
        (dict(sym=False), "asymmetric zeros (symmetric only)"),
        (dict(gs=-1), "channel-wise (group > 0 only)"),
    ],
)
def test_native_rdna3_refuses_what_it_cannot_serve(case, reason) -> None:
    L = _layer(**case)
    sel = _select(L, torch.float16, kernels=_native(doubles.RDNA3_V2FLAG))
    assert sel.skipped[0] == (f"native:{doubles.RDNA3_V2FLAG}::gptq_gemm_rdna3", reason)
    assert sel.skipped[1][0] == "triton" and "TRITON_INTERPRET" in sel.skipped[1][1]
    assert sel.kernel == "torch-reference"
    _assert_matches(sel, L, torch.float16)


@pytest.mark.parametrize(
    "dev,reason",
    [
        (dispatch.DeviceInfo("cuda", True, "gfx1030"), "arch gfx1030 (gfx1100 only)"),
        (dispatch.DeviceInfo("cuda", True, "gfx942"), "arch gfx942 (gfx1100 only)"),
        (dispatch.DeviceInfo("cuda", False, None), "arch n/a (gfx1100 only)"),
    ],
)
def test_native_rdna3_is_gfx1100_only(dev, reason) -> None:
    k = _native(doubles.RDNA3_V2FLAG)[0]
    layer, _ = dispatch.pack_layer(
        dispatch.Checkpoint(*(lambda L: (L.qweight, L.qzeros, L.scales, L.g_idx))(_layer())),
        bits=4,
        group_size=64,
        desc_act=False,
        declared="v1",
    )
    assert k.unavailable(layer, torch.float16, dev) == reason


def test_act_order_row_shard_is_not_given_to_the_native_op() -> None:
    """Row-parallel act-order shard: full scales, the shard's rows, global group ids.
    After sorting the groups are not k // group_size, so the op (which has no
    g_idx) cannot serve it; the per-row path does, correctly."""
    L = _layer(gs=32, act=True, seed=3)
    lo, hi = K // 2, K
    ck = dispatch.Checkpoint(R.pack_rows(L.q[lo:hi], 4), L.qzeros, L.scales, L.g_idx[lo:hi].contiguous())
    sel = dispatch.select(
        ck,
        bits=4,
        group_size=32,
        desc_act=True,
        declared="v1",
        dtype=torch.float16,
        prefix="t",
        dev=GFX1100,
        kernels=_native(doubles.RDNA3_V2FLAG),
    )
    assert sel.skipped[0][1] == "act-order groups not contiguous in this shard"
    x = R.check_inputs(3, hi - lo, torch.float16, "cpu")
    assert R.compare(sel.gemm(x), x.float() @ L.w[lo:hi], torch.float16).ok


# --------------------------------------------------------------------------- #
# Self-check and fallback
# --------------------------------------------------------------------------- #
def test_garbage_from_a_native_kernel_is_caught_and_logged(caplog) -> None:
    L = _layer(seed=4)
    with caplog.at_level(logging.ERROR, logger="sglang_l3.quant"):
        sel = _select(L, torch.float16, kernels=_native(doubles.RDNA3_NO_SHUFFLE), prefix="model.layers.3.o_proj")
    assert sel.kernel == "torch-reference"
    name, why = sel.skipped[0]
    assert name.startswith("native:") and why.startswith("self-check mismatch")
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "model.layers.3.o_proj" in msg and "FAILED its load-time self-check" in msg
    _assert_matches(sel, L, torch.float16)
    last = dispatch.decisions()[-1]
    assert last["prefix"] == "model.layers.3.o_proj" and last["kernel"] == "torch-reference"


def test_a_kernel_that_raises_is_skipped_loudly(caplog) -> None:
    L = _layer(seed=5)
    with caplog.at_level(logging.ERROR, logger="sglang_l3.quant"):
        sel = _select(L, torch.float16, kernels=_native(doubles.RDNA3_RAISES))
    assert sel.kernel == "torch-reference"
    assert "self-check raised RuntimeError: hipErrorNoBinaryForGpu" in sel.skipped[0][1]
    assert any("raised during its load-time self-check" in r.getMessage() for r in caplog.records)


def test_no_kernel_reproducing_the_reference_is_an_error() -> None:
    L = _layer(seed=6)
    with pytest.raises(RuntimeError, match="no kernel reproduces the reference"):
        _select(L, torch.float16, kernels=_native(doubles.RDNA3_NO_SHUFFLE)[:1])


def test_misdeclared_v2_checkpoint_is_read_as_v2() -> None:
    """Qwen GPTQ-Int4: checkpoint_format 'gptq' (v1) with v2 zeros. The torch kernel
    is served the detected format; served the declared one it fails the check."""
    L = _layer(fmt="v2", seed=7)
    sel = _select(L, torch.float16, declared="v1", kernels=[dispatch.TorchKernel()])
    assert sel.fmt == "v2" and "overridden" in sel.fmt_reason
    _assert_matches(sel, L, torch.float16)

    class DeclaredFormatTorch(dispatch.TorchKernel):  # what a format-blind loader does
        name = "torch-declared-v1"

        def prepare(self, layer, dtype):
            layer.fmt = "v1"
            return super().prepare(layer, dtype)

    with pytest.raises(RuntimeError, match="self-check mismatch"):
        _select(L, torch.float16, declared="v1", kernels=[DeclaredFormatTorch()])


# --------------------------------------------------------------------------- #
# sgl_kernel::gptq_gemm
# --------------------------------------------------------------------------- #
def _sgl_kernels():
    found = dispatch.discover(namespaces_first=[doubles.SGL])
    assert found.sgl_gemm is not None and found.sgl_shuffle is not None
    return [dispatch.SglKernelGemm(found.sgl_gemm, found.sgl_shuffle), dispatch.TorchKernel()]


@pytest.mark.parametrize("stored", ("v1", "v2"))
def test_sgl_kernel_gemm_serves_fp16_with_v1_zeros(stored) -> None:
    L = _layer(fmt=stored, seed=8)
    cuda_rdna2 = dispatch.DeviceInfo("cuda", True, "gfx1030")
    sel = _select(L, torch.float16, kernels=_sgl_kernels(), dev=cuda_rdna2)
    assert sel.kernel == f"native:{doubles.SGL}::gptq_gemm" and sel.check.ok
    assert sel.tensors["g_idx"].numel() == 0, "shuffled path: rows sequential, no g_idx"
    assert torch.equal(R.zero_points(sel.tensors["qzeros"], 4, "v1"), L.zeros), "zeros re-encoded as v1"
    _assert_matches(sel, L, torch.float16)
    sel = _select(L, torch.bfloat16, kernels=_sgl_kernels(), dev=cuda_rdna2)
    assert sel.skipped[0][1] == "activation dtype torch.bfloat16 (fp16 only)"


def test_sgl_kernel_gemm_unshuffled_with_g_idx_for_act_order_shards() -> None:
    L = _layer(gs=32, act=True, seed=9)
    lo, hi = 0, K // 2
    ck = dispatch.Checkpoint(R.pack_rows(L.q[lo:hi], 4), L.qzeros, L.scales, L.g_idx[lo:hi].contiguous())
    sel = dispatch.select(
        ck,
        bits=4,
        group_size=32,
        desc_act=True,
        declared="v1",
        dtype=torch.float16,
        prefix="t",
        dev=dispatch.DeviceInfo("cuda", True, "gfx1030"),
        kernels=_sgl_kernels(),
    )
    assert sel.kernel.endswith("::gptq_gemm") and sel.tensors["g_idx"].numel() == hi - lo
    x = R.check_inputs(3, hi - lo, torch.float16, "cpu")
    assert R.compare(sel.gemm(x), x.float() @ L.w[lo:hi], torch.float16).ok


# --------------------------------------------------------------------------- #
# doctor
# --------------------------------------------------------------------------- #
def test_doctor_table_on_simulated_gfx1100(monkeypatch) -> None:
    from sglang_l3.quant import doctor

    monkeypatch.setattr(dispatch, "installed", lambda: dispatch.discover([doubles.RDNA3_V2FLAG]))
    monkeypatch.setattr(dispatch, "_DECISIONS", [])  # a fresh serving process
    rep = doctor.report(dev=dispatch.DeviceInfo("cuda", True, "gfx1100"))
    assert rep["ok"] and rep["data"]["applicable"]
    rows = {(r["bits"], r["format"], r["dtype"]): r for r in rep["data"]["table"]}
    assert len(rows) == 4 * 2 * 2
    native = f"native:{doubles.RDNA3_V2FLAG}::gptq_gemm_rdna3"
    for fmt in ("v1", "v2"):
        for dt in ("fp16", "bf16"):
            assert rows[(4, fmt, dt)]["kernel"] == native
            assert rows[(3, fmt, dt)]["kernel"] == "triton"
            assert rows[(3, fmt, dt)]["skipped"] == [(native, "3-bit (4-bit only)")]
    assert any("4-bit v2 bf16: " + native in line for line in rep["lines"])


@pytest.mark.skipif(torch.version.hip is not None, reason="this is a ROCm machine")
def test_doctor_off_rocm_says_not_applicable() -> None:
    from sglang_l3.quant import doctor

    rep = doctor.report()
    assert rep["ok"] and rep["data"] == {"applicable": False, "reason": "not ROCm (torch.version.hip is None)"}
    assert rep["lines"] == ["gptq-rocm: not applicable here (not ROCm (torch.version.hip is None))"]


def test_doctor_fails_after_a_self_check_fallback_in_this_process(monkeypatch) -> None:
    from sglang_l3.quant import doctor

    monkeypatch.setattr(dispatch, "_DECISIONS", [])
    _select(_layer(seed=10), torch.float16, kernels=_native(doubles.RDNA3_NO_SHUFFLE), prefix="model.layers.9.q")
    rep = doctor.report(dev=dispatch.DeviceInfo("cuda", True, "gfx1100"))
    assert not rep["ok"]
    assert any("1 fell back after a failed self-check" in line for line in rep["lines"])
    assert any(line.strip().startswith("model.layers.9.q: now torch-reference") for line in rep["lines"])
