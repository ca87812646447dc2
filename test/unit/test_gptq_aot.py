"""Ahead-of-time compile of the Triton GPTQ kernel for gfx1100 (RDNA3), no GPU needed.

Every launch config the dispatcher can pick for 4-bit (each M bucket, sequential
groups and act-order g_idx), and the decode config for 2/3/8-bit, is compiled by
Triton's AMD backend (bundled LLVM + linker in the pinned triton wheel). Checked
from the emitted ISA and its AMDGPU metadata: the dot products lower to WMMA
(v_wmma_f32_16x16x16_{f16,bf16}); the common decode shapes (4-bit, group 128,
M <= 16) do not spill VGPRs; no variant spills heavily. `-v` prints the table;
`python -m sglang_l3.quant.gptq_triton` prints it standalone.
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
    return [(v, T.aot_compile(b, dt, cfg, has_gidx=g)) for v in T.aot_variants() for b, dt, cfg, g in [v]]


def test_every_variant_uses_wmma(table, request, capsys) -> None:
    if request.config.getoption("verbose") > 0:
        with capsys.disabled():
            print(f"\n{'variant':44s} {'wmma':28s} {'vgpr':>4s} {'spill':>5s} {'scratch':>7s}")
            for _, r in table:
                print(
                    f"{r.variant:44s} {','.join(r.wmma) or 'NONE':28s} {r.vgpr:4d} {r.spills:5d} {r.scratch_bytes:7d}"
                )
    for (_bits, dtype, _cfg, _gidx), r in table:
        want = "v_wmma_f32_16x16x16_f16" if dtype == torch.float16 else "v_wmma_f32_16x16x16_bf16"
        assert want in r.wmma, f"{r.variant}: no {want} (found {r.wmma})"
        assert r.arch == "gfx1100" and 0 < r.vgpr <= 256


def test_decode_shapes_do_not_spill(table) -> None:
    decode = [r for (bits, _, cfg, gidx), r in table if bits == 4 and cfg.BM == 16 and not gidx]
    assert len(decode) == 2  # fp16, bf16
    for r in decode:
        assert r.spills == 0 and r.scratch_bytes == 0, r


def test_no_variant_spills_heavily(table) -> None:
    heavy = [r for _, r in table if r.scratch_bytes > HEAVY_SCRATCH_BYTES]
    assert not heavy, heavy
