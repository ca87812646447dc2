"""GPTQ kernels on a real GPU (CUDA or ROCm); skipped without one (conftest).

The compiled Triton kernel (the production path, including bf16 tl.dot, which the
CPU interpreter cannot check), the dispatcher's choice and self-check on the
device, and CUDA/HIP graph capture of the chosen kernel. `rdna3` tests need gfx11.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from sglang_l3.quant import dispatch
from sglang_l3.quant import gptq_ref as R

pytestmark = pytest.mark.gpu
DEV = "cuda"
K, N = 512, 320  # N not a multiple of BN=64


def _layer(bits, gs, act, sym, fmt, dtype, seed=0, k=K, n=N):
    g = torch.Generator().manual_seed(seed)
    L = R.quantize(
        torch.randn(k, n, generator=g) * 0.05, bits, gs, sym=sym, act_order=act, fmt=fmt, scale_dtype=dtype, seed=seed
    )
    for f in ("qweight", "qzeros", "scales", "g_idx", "w"):
        setattr(L, f, getattr(L, f).to(DEV))
    return L


COMBOS = list(
    itertools.product(
        (2, 3, 4, 8),
        ((128, False), (64, True), (-1, False)),
        (True, False),
        ("v1", "v2"),
        (torch.float16, torch.bfloat16),
    )
)


@pytest.mark.parametrize(
    "combo",
    COMBOS,
    ids=lambda c: f"b{c[0]}-g{c[1][0]}{'-act' if c[1][1] else ''}-{'sym' if c[2] else 'asym'}-{c[3]}-{str(c[4])[6:]}",
)
def test_compiled_triton_matches_reference(combo) -> None:
    from sglang_l3.quant.gptq_triton import gptq_gemm

    bits, (gs, act), sym, fmt, dtype = combo
    L = _layer(bits, gs, act, sym, fmt, dtype)
    for m in (1, 2, 3, 8, 16, 19, 40, 130):  # GEMV 1/2/4 rows, split-K tl.dot, tl.dot tiles
        x = R.check_inputs(m, K, dtype, DEV, seed=m)
        out = gptq_gemm(x, L.qweight, L.qzeros, L.scales, L.g_idx if act else None, bits, gs, fmt)
        c = R.compare(out, x.float() @ L.w, dtype)
        assert c.ok, (m, c)
        other = "v2" if fmt == "v1" else "v1"
        bad = gptq_gemm(x, L.qweight, L.qzeros, L.scales, L.g_idx if act else None, bits, gs, other)
        assert not R.compare(bad, x.float() @ L.w, dtype).ok


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_dispatch_on_device_and_graph_capture(dtype) -> None:
    L = _layer(4, 128, True, True, "v2", dtype, seed=1)
    sel = dispatch.select(
        dispatch.Checkpoint(L.qweight, L.qzeros, L.scales, L.g_idx),
        bits=4,
        group_size=128,
        desc_act=True,
        declared="v1",
        dtype=dtype,
        prefix="gpu",
    )
    assert sel.check.ok and sel.fmt == "v2"
    assert sel.kernel != "torch-reference", f"a GPU kernel should serve this layer: {sel.skipped}"
    x = R.check_inputs(8, K, dtype, DEV)
    eager = sel.gemm(x)
    assert R.compare(eager, x.float() @ L.w, dtype).ok
    static_x = x.clone()
    sel.gemm(static_x)  # warm (compile) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sel.gemm(static_x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, eager, rtol=0, atol=0)


@pytest.mark.rdna3
def test_rdna3_native_op_if_installed() -> None:
    info = dispatch.device_info(torch.device(DEV))
    if info.arch != "gfx1100":
        pytest.skip(f"arch {info.arch}: the native op is gfx1100 only")
    found = dispatch.installed()
    if not found.rdna3:
        pytest.skip("no gptq_gemm_rdna3 op installed: " + "; ".join(found.notes))
    L = _layer(4, 128, False, True, "v1", torch.float16, seed=2, k=4096, n=4096)
    sel = dispatch.select(
        dispatch.Checkpoint(L.qweight, L.qzeros, L.scales, L.g_idx),
        bits=4,
        group_size=128,
        desc_act=False,
        declared="v1",
        dtype=torch.float16,
        prefix="rdna3",
    )
    assert sel.kernel.startswith("native:"), sel.skipped
