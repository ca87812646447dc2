"""Ahead-of-time compile of the Triton GPTQ kernels for gfx1100 (RDNA3), no GPU needed.

Every launch config the dispatcher can pick for 4-bit on gfx1100 (gfx1100's
decode table: the GEMV kernel holding 1, 2 and 4 rows and tl.dot split over K;
each tl.dot M bucket above it; sequential groups and act-order g_idx), the
decode configs for 2/3/8-bit, and the split-K reduction are compiled by Triton's
AMD backend (bundled LLVM + linker in the pinned triton wheel). Checked from the
emitted ISA and its AMDGPU metadata: the tl.dot kernels lower to WMMA
(v_wmma_f32_16x16x16_{f16,bf16}); nothing the decode path launches (M <= 16,
every bit width) spills VGPRs; no variant spills heavily. The sm90 decode
variants (the H200 of test/gpu/device_check.sh) compile with the NVIDIA backend
without local memory. `-v` prints the table; `python -m sglang_l3.quant.gptq_triton
[gfx1100|sm90]` prints it standalone.
Select with `-m aot`; runs in the default CPU suite.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.aot

HEAVY_SCRATCH_BYTES = 256  # per-lane scratch above this counts as a heavy spill


@pytest.fixture(scope="module")
def table():
    from sglang_l3.quant import gptq_triton as T

    if T.interpreting():
        pytest.skip("TRITON_INTERPRET=1 in this process: Triton cannot compile here")
    if importlib.util.find_spec("triton.backends.amd") is None:
        pytest.skip("this triton wheel has no AMD backend")
    return [(v, T.aot_compile(b, dt, cfg, has_gidx=g)) for v in T.aot_variants("gfx1100") for b, dt, cfg, g in [v]]


@pytest.fixture(scope="module")
def reduce_reports():
    from sglang_l3.quant import gptq_triton as T

    if T.interpreting() or importlib.util.find_spec("triton.backends.amd") is None:
        pytest.skip("no AOT compile here")
    return [T.aot_compile_reduce(dt) for dt in (torch.float16, torch.bfloat16)]


def test_every_dot_variant_uses_wmma(table, request, capsys) -> None:
    if request.config.getoption("verbose") > 0:
        with capsys.disabled():
            print(f"\n{'variant':60s} {'wmma':28s} {'vgpr':>4s} {'spill':>5s} {'scratch':>7s}")
            for _, r in table:
                print(
                    f"{r.variant:60s} {','.join(r.wmma) or 'NONE':28s} {r.vgpr:4d} {r.spills:5d} {r.scratch_bytes:7d}"
                )
    for (_bits, dtype, cfg, _gidx), r in table:
        assert r.arch == "gfx1100" and 0 < r.vgpr <= 256
        if cfg.kind == "gemv":
            assert not r.wmma, r  # no tl.dot in the GEMV kernel
            continue
        want = "v_wmma_f32_16x16x16_f16" if dtype == torch.float16 else "v_wmma_f32_16x16x16_bf16"
        assert want in r.wmma, f"{r.variant}: no {want} (found {r.wmma})"


def test_the_table_covers_every_decode_launch() -> None:
    """What dispatch launches at M <= 16 on gfx1100 is in the compiled set."""
    from sglang_l3.quant import gptq_triton as T

    compiled = {(cfg.kind, cfg.BM, cfg.BN, cfg.BK, cfg.num_warps) for _, _, cfg, _ in T.aot_variants("gfx1100")}
    for m in range(1, 17):
        for gs, gidx in ((128, False), (128, True), (32, False)):
            c = T.pick_config(m, gs, gidx, K=5120, N=7168, bits=4, arch="gfx1100", cus=96)
            if gs == 128:
                assert (c.kind, c.BM, c.BN, c.BK, c.num_warps) in compiled, c
            assert c.kind == ("gemv" if m <= 4 else "dot") and c.split_k > 1, c


def test_decode_shapes_do_not_spill(table, reduce_reports) -> None:
    decode = [r for (_, _, cfg, _), r in table if cfg.kind == "gemv" or cfg.split_k > 1]
    # fp16 + bf16: 4-bit GEMV (BM 1/2/4) and split-K tl.dot, seq and g_idx; 2/3/8-bit BM1 + tl.dot
    assert len(decode) == 2 * (4 * 2 + 3 * 2), [r.variant for r in decode]
    for r in decode + reduce_reports:
        assert r.spills == 0 and r.scratch_bytes == 0, r


def test_sm90_decode_variants_use_no_local_memory() -> None:
    """The 4-bit fp16 decode launches of the sm90 table (the H200 the device check
    runs on) compile with Triton's NVIDIA backend (bundled ptxas) without spilling to
    local memory, and the split-K tl.dot uses the tensor cores."""
    from sglang_l3.quant import gptq_triton as T

    if T.interpreting():
        pytest.skip("TRITON_INTERPRET=1 in this process: Triton cannot compile here")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton wheel has no NVIDIA backend")
    decode = [
        (cfg, g)
        for b, dt, cfg, g in T.aot_variants("sm90")
        if b == 4 and dt == torch.float16 and (cfg.kind == "gemv" or cfg.split_k > 1)
    ]
    assert len(decode) == 8
    for cfg, g in decode:
        r = T.aot_compile(4, torch.float16, cfg, has_gidx=g, arch="sm90")
        assert r.scratch_bytes == 0 and 0 < r.vgpr <= 255, r
        assert bool(r.wmma) == (cfg.kind == "dot"), r


def test_no_variant_spills_heavily(table) -> None:
    heavy = [r for _, r in table if r.scratch_bytes > HEAVY_SCRATCH_BYTES]
    assert not heavy, heavy
