"""Test doubles of GPU-only native GPTQ ops, registered with torch.library on CPU.

gptq_gemm_rdna3 (vLLM _rocm_C) and sgl_kernel::gptq_gemm only exist as HIP/CUDA
kernels, so the dispatcher's discovery, schema probing, argument mapping, weight
shuffling and self-check fallback are exercised against these doubles, which
implement the ops' documented contracts in torch (ExLlama-shuffled 4-bit weights,
zeros v1 unless use_v2_format). Deliberately broken variants model a kernel that
was never run on this GPU and returns garbage. No tests in this module.
"""

from __future__ import annotations

import torch
from sglang_l3.quant import gptq_ref as R

_LIBS: list[torch.library.Library] = []

# namespace -> (schema, kind)
RDNA3_V2FLAG = "sglang_l3_test"  # current vLLM signature
RDNA3_OLD = "sglang_l3_test_old"  # a gptq_gemm-style (use_shuffle, bit) signature, v1 only
RDNA3_UNKNOWN_ARG = "sglang_l3_test_unknown"
RDNA3_NO_SHUFFLE = "sglang_l3_test_broken"  # reads the weights unshuffled: garbage
RDNA3_RAISES = "sglang_l3_test_raises"
SGL = "sglang_l3_test_sgl"  # sgl_kernel::gptq_gemm + gptq_shuffle

_SCHEMA_V2 = (
    "gptq_gemm_rdna3(Tensor a, Tensor b_q_weight, Tensor b_qzeros, Tensor b_scales, "
    "Tensor b_g_idx, bool use_v2_format) -> Tensor"
)
_SCHEMA_OLD = (
    "gptq_gemm_rdna3(Tensor a, Tensor b_q_weight, Tensor b_gptq_qzeros, "
    "Tensor b_gptq_scales, Tensor b_g_idx, bool use_shuffle, int bit) -> Tensor"
)
_SCHEMA_UNKNOWN = (
    "gptq_gemm_rdna3(Tensor a, Tensor b_q_weight, Tensor b_qzeros, Tensor b_scales, "
    "Tensor b_g_idx, bool use_v2_format, int split_k) -> Tensor"
)
CALLS: dict[str, int] = {}


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


def _rdna3(a, q, z, s, g, v2: bool, *, shuffled: bool = True):
    assert g.numel() == 0, "the RDNA3 op gets no g_idx (rows are pre-sorted)"
    K, G = q.shape[0] * 8, s.shape[0]
    qw = R.exllama_unshuffle_4bit(q) if shuffled else q
    groups = torch.arange(K, dtype=torch.int32) // (K // G)
    w = R.dequantize(qw, z, s, groups, 4, "v2" if v2 else "v1", dtype=a.dtype)
    return a @ w


def _rdna3_v2(a, q, z, s, g, use_v2_format):
    _count(RDNA3_V2FLAG)
    return _rdna3(a, q, z, s, g, use_v2_format)


def _rdna3_old(a, q, z, s, g, use_shuffle, bit):
    _count(RDNA3_OLD)
    assert use_shuffle and bit == 4
    return _rdna3(a, q, z, s, g, False)


def _rdna3_broken(a, q, z, s, g, use_v2_format):
    _count(RDNA3_NO_SHUFFLE)
    return _rdna3(a, q, z, s, g, use_v2_format, shuffled=False)


def _rdna3_raises(a, q, z, s, g, use_v2_format):
    raise RuntimeError("hipErrorNoBinaryForGpu: no kernel image for gfx1100")


def _sgl_gemm(a, q, z, s, g, use_shuffle, bit):
    """sgl_kernel::gptq_gemm: fp16, v1 zeros; shuffled weights need an empty g_idx."""
    _count(SGL)
    assert a.dtype == torch.float16
    qw = q
    if use_shuffle:
        assert g.numel() == 0 and bit == 4
        qw = R.exllama_unshuffle_4bit(q)
        g = torch.arange(q.shape[0] * 32 // bit, dtype=torch.int32) // (q.shape[0] * 32 // bit // s.shape[0])
    return a @ R.dequantize(qw, z, s, g, bit, "v1", dtype=a.dtype)


def _sgl_shuffle(q, perm, bit):
    assert perm.numel() == 0
    if bit != 4:
        raise NotImplementedError("double shuffles 4-bit only")
    q.copy_(R.exllama_shuffle_4bit(q))


def register() -> None:
    if _LIBS:
        return
    for ns, schema, fn in (
        (RDNA3_V2FLAG, _SCHEMA_V2, _rdna3_v2),
        (RDNA3_OLD, _SCHEMA_OLD, _rdna3_old),
        (RDNA3_UNKNOWN_ARG, _SCHEMA_UNKNOWN, None),
        (RDNA3_NO_SHUFFLE, _SCHEMA_V2, _rdna3_broken),
        (RDNA3_RAISES, _SCHEMA_V2, _rdna3_raises),
    ):
        lib = torch.library.Library(ns, "DEF")
        lib.define(schema)
        if fn is not None:
            lib.impl("gptq_gemm_rdna3", fn, "CPU")
        _LIBS.append(lib)
    lib = torch.library.Library(SGL, "DEF")
    lib.define(
        "gptq_gemm(Tensor a, Tensor b_q_weight, Tensor b_gptq_qzeros, Tensor b_gptq_scales, "
        "Tensor b_g_idx, bool use_shuffle, int bit) -> Tensor"
    )
    lib.define("gptq_shuffle(Tensor(a!) q_weight, Tensor q_perm, int bit) -> ()")
    lib.impl("gptq_gemm", _sgl_gemm, "CPU")
    lib.impl("gptq_shuffle", _sgl_shuffle, "CPU")
    _LIBS.append(lib)
