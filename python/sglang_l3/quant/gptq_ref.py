"""GPTQ checkpoint format: packer, dequantizer, RTN quantizer, zero-format detection.

Layout (AutoGPTQ / GPTQModel "gptq" format, as loaded by SGLang's GPTQ linear):
  qweight int32 [K*bits/32, N]   packed along K: element k at bit k*bits of column n's stream
  qzeros  int32 [G, N*bits/32]   packed along N the same way
  scales        [G, N]           activation dtype
  g_idx   int32 [K]              group of input row k (k // group_size unless act-order)
  W[k, n] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]
  zero = stored + 1 (v1, the AutoGPTQ off-by-one) | stored (v2)
v1 adds 1 *after* unpacking, without masking: stored 2^bits - 1 decodes to 2^bits.

Everything here is plain torch and vectorised, so it serves three roles: the
tests' reference, the load-time self-check's reference, and the last-resort
runtime kernel (dequantize + matmul).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ZeroFormat = Literal["v1", "v2"]
SUPPORTED_BITS = (2, 3, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"GPTQ bits must be one of {SUPPORTED_BITS}, got {bits}")


def _period(bits: int) -> tuple[int, int]:
    """(values, words) of the smallest repeating pack unit: 32//bits values in 1 word,
    or 32 values in 3 words for 3-bit."""
    words = bits // math.gcd(bits, 32)
    return words * 32 // bits, words


def pack_rows(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C] with values in [0, 2^bits) -> int32 [R*bits/32, C] (packed along rows)."""
    _check_bits(bits)
    R, C = vals.shape
    P, W = _period(bits)
    if R % P:
        raise ValueError(f"{R} rows cannot be packed at {bits} bits (need a multiple of {P})")
    v = vals.to(torch.int64).reshape(R // P, P, C)
    out = torch.zeros(R // P, W, C, dtype=torch.int64, device=vals.device)
    for r in range(P):
        w, off = divmod(r * bits, 32)
        out[:, w] |= (v[:, r] << off) & 0xFFFFFFFF
        if off + bits > 32:  # 3-bit values straddle two words
            out[:, w + 1] |= v[:, r] >> (32 - off)
    out = out.reshape(R * bits // 32, C)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def unpack_rows(packed: torch.Tensor, bits: int, rows: int | None = None) -> torch.Tensor:
    """int32 [R*bits/32, C] -> int32 [R, C]."""
    _check_bits(bits)
    P, W = _period(bits)
    words, C = packed.shape
    if words % W:
        raise ValueError(f"{words} packed rows is not a multiple of {W} ({bits}-bit)")
    p = (packed.to(torch.int64) & 0xFFFFFFFF).reshape(words // W, W, C)
    pos = torch.arange(P, device=packed.device) * bits
    w_lo, off = pos // 32, (pos % 32).view(1, P, 1)
    w_hi = torch.clamp(w_lo + 1, max=W - 1)
    # One formula for every width: the high word's bits land at >= 32 - off >= bits
    # unless the value straddles, so the mask drops them.
    both = p[:, w_lo] | (p[:, w_hi] << 32)
    out = ((both >> off) & ((1 << bits) - 1)).reshape(words // W * P, C).to(torch.int32)
    return out if rows is None else out[:rows]


def pack_cols(vals: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_rows(vals.t(), bits).t().contiguous()


def unpack_cols(packed: torch.Tensor, bits: int, cols: int | None = None) -> torch.Tensor:
    return unpack_rows(packed.t(), bits, cols).t().contiguous()


def zero_points(qzeros: torch.Tensor, bits: int, fmt: ZeroFormat, cols: int | None = None) -> torch.Tensor:
    """Real zero points int32 [G, N] from stored qzeros."""
    z = unpack_cols(qzeros, bits, cols)
    return z + 1 if fmt == "v1" else z


def encode_zeros(zeros: torch.Tensor, bits: int, fmt: ZeroFormat) -> torch.Tensor:
    """Real zero points [G, N] -> stored qzeros. v1 stores zero-1 (zero 0 wraps to 2^bits-1)."""
    stored = zeros.to(torch.int64) - (1 if fmt == "v1" else 0)
    return pack_cols(stored & ((1 << bits) - 1), bits)


def convert_zero_format(qzeros: torch.Tensor, bits: int, src: ZeroFormat, dst: ZeroFormat) -> torch.Tensor:
    """Re-encode stored zeros. Raises if a real zero cannot be represented in dst."""
    if src == dst:
        return qzeros
    z = zero_points(qzeros, bits, src)
    if dst == "v1" and bool((z == 0).any()):
        raise ValueError("a zero point of 0 cannot be represented in the GPTQ v1 format")
    if dst == "v2" and bool((z >= (1 << bits)).any()):
        raise ValueError(f"a v1 zero point of {1 << bits} cannot be represented in v2")
    return encode_zeros(z, bits, dst)


# --------------------------------------------------------------------------- #
# v1 / v2 detection
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class FormatDecision:
    fmt: ZeroFormat
    symmetric: bool  # every real zero point is the symmetric centre 2^(bits-1)
    reason: str


def detect_zero_format(qzeros: torch.Tensor, bits: int, declared: ZeroFormat) -> FormatDecision:
    """Decide v1/v2 from the stored zeros, not only from checkpoint_format.

    Symmetric GPTQ puts every zero at the centre C = 2^(bits-1): v1 stores C-1
    everywhere, v2 stores C. Some GPTQModel checkpoints (e.g. Qwen GPTQ-Int4)
    say "gptq" (v1) but store C; read as v1 every weight is off by one scale
    step (vLLM PR #38966). Asymmetric zeros carry no such signature, so the
    declared format stands.
    """
    _check_bits(bits)
    stored = unpack_cols(qzeros, bits)
    centre = 1 << (bits - 1)
    if stored.numel() and bool((stored == centre).all()):
        why = "stored zeros all = 2^(bits-1): symmetric v2"
        if declared == "v1":
            why += " (checkpoint says v1: overridden)"
        return FormatDecision("v2", True, why)
    if stored.numel() and bool((stored == centre - 1).all()):
        why = "stored zeros all = 2^(bits-1)-1: symmetric v1"
        if declared == "v2":
            why += " (checkpoint says v2: overridden)"
        return FormatDecision("v1", True, why)
    return FormatDecision(declared, False, f"asymmetric zeros: declared {declared} kept")


# --------------------------------------------------------------------------- #
# Dequantize / reference matmul
# --------------------------------------------------------------------------- #
def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    fmt: ZeroFormat,
    *,
    cols: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[K, N] (or [K, len(cols)]) weights. dtype=None: fp32 (exact for the check);
    otherwise the product is formed in fp32 and rounded once to dtype."""
    if cols is not None:
        qweight, scales = qweight[:, cols], scales[:, cols]
    q = unpack_rows(qweight, bits)
    z = zero_points(qzeros, bits, fmt)
    if cols is not None:
        z = z[:, cols]
    g = g_idx.long()
    w = (q - z[g]).float() * scales.float()[g]
    return w if dtype is None else w.to(dtype)


def reference_matmul(
    x: torch.Tensor, qweight, qzeros, scales, g_idx, bits: int, fmt: ZeroFormat, cols: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 x @ W: the ground truth every kernel is compared with."""
    return x.float() @ dequantize(qweight, qzeros, scales, g_idx, bits, fmt, cols=cols)


def torch_gemm(x: torch.Tensor, qweight, qzeros, scales, g_idx, bits: int, fmt: ZeroFormat) -> torch.Tensor:
    """Last-resort runtime kernel: dequantize to the activation dtype and matmul."""
    w = dequantize(qweight, qzeros, scales, g_idx, bits, fmt, dtype=x.dtype)
    return x @ w


# --------------------------------------------------------------------------- #
# Comparison within output-dtype rounding
# --------------------------------------------------------------------------- #
def unit_roundoff(dtype: torch.dtype) -> float:
    return {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[dtype]


@dataclass(frozen=True)
class Comparison:
    ok: bool
    rel_l2: float  # ||out - ref|| / ||ref||
    max_rel: float  # max|out - ref| / max|ref|
    tol_l2: float
    tol_max: float

    def __str__(self) -> str:
        return f"rel_l2={self.rel_l2:.3g} (tol {self.tol_l2:.3g}), max_rel={self.max_rel:.3g} (tol {self.tol_max:.3g})"


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Comparison:
    """A kernel matches when its error is a few roundings of its output dtype:
    the output is rounded once (<= u relative), weights or partial products may
    be rounded to the activation dtype once more, and ExLlama-style kernels sum
    short runs in fp16 before fp32. Measured: our kernels stay below 2u; a wrong
    zero format or an ignored g_idx costs > 7% (see the tests)."""
    u = unit_roundoff(dtype)
    diff = out.float() - ref.float()
    ref_norm = ref.float().norm().item()
    ref_max = ref.float().abs().max().item() if ref.numel() else 0.0
    rel_l2 = diff.norm().item() / max(ref_norm, 1e-30)
    max_rel = (diff.abs().max().item() if diff.numel() else 0.0) / max(ref_max, 1e-30)
    tol_l2, tol_max = 8 * u, 16 * u
    finite = bool(torch.isfinite(out.float()).all())
    return Comparison(finite and rel_l2 <= tol_l2 and max_rel <= tol_max, rel_l2, max_rel, tol_l2, tol_max)


def check_inputs(m: int, k: int, dtype: torch.dtype, device, seed: int = 1234) -> torch.Tensor:
    """Self-check activations. Mean 1, not 0: a zero-point error adds s*sum(x) to
    each output, which a zero-mean input would average away (8-bit off-by-one
    would then hide inside bf16 rounding)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(m, k, generator=g) + 1.0).to(dtype=dtype, device=device)


# --------------------------------------------------------------------------- #
# act-order: sort K once
# --------------------------------------------------------------------------- #
def sort_by_group(qweight: torch.Tensor, g_idx: torch.Tensor, bits: int):
    """Reorder input rows so groups are contiguous. Returns (qweight', g_idx', perm)
    with W'[i] = W[perm[i]]; at run time x' = x[:, perm] gives x' @ W' == x @ W."""
    perm = torch.argsort(g_idx.long(), stable=True)
    q = unpack_rows(qweight, bits)[perm]
    return pack_rows(q, bits), g_idx[perm].contiguous(), perm


def is_sequential(g_idx: torch.Tensor, group_size: int) -> bool:
    """g_idx == k // group_size for every row (no act-order indirection needed)."""
    if group_size <= 0:
        return bool((g_idx == 0).all())
    k = torch.arange(g_idx.numel(), device=g_idx.device)
    return bool((g_idx.long() == k // group_size).all())


# --------------------------------------------------------------------------- #
# ExLlama 4-bit shuffle (the layout gptq_gemm_rdna3 / gptq_gemm(use_shuffle) read)
# --------------------------------------------------------------------------- #
_EXL4 = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of the shuffled word holds element _EXL4[j]


def exllama_shuffle_4bit(qweight: torch.Tensor) -> torch.Tensor:
    """Within each int32 of 8 K-consecutive nibbles, put even elements in the low
    half-word and odd ones in the high half-word ("77775555 33331111 66664444
    22220000" in ExLlama's qdq_4.cuh)."""
    p = qweight.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(p)
    for j, e in enumerate(_EXL4):
        out |= ((p >> (4 * e)) & 0xF) << (4 * j)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def exllama_unshuffle_4bit(qweight: torch.Tensor) -> torch.Tensor:
    p = qweight.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(p)
    for j, e in enumerate(_EXL4):
        out |= ((p >> (4 * j)) & 0xF) << (4 * e)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


# --------------------------------------------------------------------------- #
# RTN quantizer (builds test layers; GPTQ's Hessian step changes values, not format)
# --------------------------------------------------------------------------- #
@dataclass
class GPTQLayer:
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int  # as in the config (-1 = one group)
    fmt: ZeroFormat
    sym: bool
    q: torch.Tensor  # int [K, N] quantized values
    zeros: torch.Tensor  # int [G, N] real zero points
    w: torch.Tensor  # fp32 [K, N] exact dequantized weights

    @property
    def K(self) -> int:
        return self.q.shape[0]

    @property
    def N(self) -> int:
        return self.q.shape[1]


def quantize(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    sym: bool = True,
    act_order: bool = False,
    fmt: ZeroFormat = "v1",
    scale_dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> GPTQLayer:
    """Round-to-nearest GPTQ layer from w [K, N] (= nn.Linear.weight.T)."""
    _check_bits(bits)
    K, N = w.shape
    gs = K if group_size == -1 else group_size
    if K % gs:
        raise ValueError(f"K={K} is not a multiple of group_size={gs}")
    G, maxq = K // gs, (1 << bits) - 1
    gen = torch.Generator().manual_seed(seed)
    # act-order: GPTQ visits rows in a permuted order, groups are formed along
    # that order, and g_idx maps each original row to its group.
    perm = torch.randperm(K, generator=gen) if act_order else torch.arange(K)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K) // gs).to(torch.int32)
    wf = w.float()
    blocks = wf[perm].reshape(G, gs, N)  # rows of group gi are perm[gi*gs:(gi+1)*gs]
    lo, hi = blocks.amin(1).clamp(max=0), blocks.amax(1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    s = (hi - lo).clamp(min=1e-8) / maxq
    z = torch.full_like(s, (maxq + 1) // 2) if sym else torch.round(-lo / s)
    if not sym and fmt == "v1":
        z = z.clamp(min=1)  # v1 cannot store a zero of 0
    zeros = z.to(torch.int64)
    scales = s.to(scale_dtype)
    g = g_idx.long()
    q = torch.clamp(torch.round(wf / scales.float()[g]) + zeros[g], 0, maxq).to(torch.int64)
    return GPTQLayer(
        qweight=pack_rows(q, bits),
        qzeros=encode_zeros(zeros, bits, fmt),
        scales=scales,
        g_idx=g_idx,
        bits=bits,
        group_size=group_size,
        fmt=fmt,
        sym=sym,
        q=q.to(torch.int32),
        zeros=zeros.to(torch.int32),
        w=(q - zeros[g]).float() * scales.float()[g],
    )
