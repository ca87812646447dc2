"""Triton fused dequant-GEMM for GPTQ in the checkpoint layout (no shuffle), bits 2/3/4/8.

out[M, N] = x[M, K] @ W[K, N],  W[k, n] = (q[k, n] - zero[g, n]) * s[g, n],  g = g_idx[k]

Two inner loops, chosen at compile time:
  TILE_GROUP  no g_idx and BK divides the group: one scale/zero row per K tile,
              so the tile is x @ (q - z) (small integers, exact in fp16/bf16)
              and the scale is applied to the fp32 partial sum.
  g_idx       per-row group lookup (act-order shards whose groups are not
              contiguous tiles after sorting): dequantize then dot.

On CPU tensors it runs under Triton's interpreter, which is a per-process mode
(TRITON_INTERPRET=1 before triton is imported: triton.language's own helpers are
wrapped at import). The same process can then not AOT-compile, so the tests run
interpreted checks in a child process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _extract(w_lo, w_hi, off, BITS: tl.constexpr):
    """Element at bit `off` of w_lo (continuing into w_hi for 3-bit straddles)."""
    mask = (1 << BITS) - 1
    lo = w_lo.to(tl.uint32, bitcast=True)
    if BITS == 3:
        hi = w_hi.to(tl.uint32, bitcast=True)
        straddle = (off + BITS) > 32
        sh = tl.where(straddle, 32 - off, 0)
        val = (lo >> off) | tl.where(straddle, hi << sh, 0)
    else:
        val = lo >> off
    return (val & mask).to(tl.int32)


@triton.jit
def gptq_gemm_kernel(
    x_ptr,
    qw_ptr,
    qz_ptr,
    s_ptr,
    gidx_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    sxm,
    sxk,
    sqk,
    sqn,
    szg,
    szn,
    ssg,
    ssn,
    som,
    son,
    BITS: tl.constexpr,
    ZOFF: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    TILE_GROUP: tl.constexpr,
    DOT_F32: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)

    # zero points are packed along N: fixed positions for this N tile
    zbit = offs_n * BITS
    zword = zbit // 32
    zoff = zbit % 32

    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * sxm + offs_k[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        kbit = offs_k * BITS
        kword = kbit // 32
        koff = kbit % 32
        wmask = k_ok[:, None] & n_ok[None, :]
        w_lo = tl.load(qw_ptr + kword[:, None] * sqk + offs_n[None, :] * sqn, mask=wmask, other=0)
        if BITS == 3:
            w_hi = tl.load(
                qw_ptr + (kword + 1)[:, None] * sqk + offs_n[None, :] * sqn,
                mask=wmask & ((koff + BITS) > 32)[:, None],
                other=0,
            )
        else:
            w_hi = w_lo
        q = _extract(w_lo, w_hi, koff[:, None], BITS)

        if TILE_GROUP:
            g1 = k0 // group_size
            s1 = tl.load(s_ptr + g1 * ssg + offs_n * ssn, mask=n_ok, other=0.0)
            z1_lo = tl.load(qz_ptr + g1 * szg + zword * szn, mask=n_ok, other=0)
            if BITS == 3:
                z1_hi = tl.load(qz_ptr + g1 * szg + (zword + 1) * szn, mask=n_ok & ((zoff + BITS) > 32), other=0)
            else:
                z1_hi = z1_lo
            z1 = _extract(z1_lo, z1_hi, zoff, BITS) + ZOFF
            wi = q - z1[None, :]
            part = tl.dot(x.to(tl.float32), wi.to(tl.float32)) if DOT_F32 else tl.dot(x, wi.to(x.dtype))
            acc += part * s1.to(tl.float32)[None, :]
        else:
            g = tl.load(gidx_ptr + offs_k, mask=k_ok, other=0) if HAS_GIDX else offs_k // group_size
            s = tl.load(s_ptr + g[:, None] * ssg + offs_n[None, :] * ssn, mask=wmask, other=0.0)
            z_lo = tl.load(qz_ptr + g[:, None] * szg + zword[None, :] * szn, mask=wmask, other=0)
            if BITS == 3:
                z_hi = tl.load(
                    qz_ptr + g[:, None] * szg + (zword + 1)[None, :] * szn,
                    mask=wmask & ((zoff + BITS) > 32)[None, :],
                    other=0,
                )
            else:
                z_hi = z_lo
            z = _extract(z_lo, z_hi, zoff[None, :], BITS) + ZOFF
            w = (q - z).to(tl.float32) * s.to(tl.float32)
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w)
            else:
                acc += tl.dot(x, w.to(x.dtype))

    tl.store(
        out_ptr + offs_m[:, None] * som + offs_n[None, :] * son,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def interpreting() -> bool:
    """TRITON_INTERPRET=1 was set before triton was imported (triton.language's own
    helpers are wrapped at import, so the mode is per process)."""
    return bool(triton.knobs.runtime.interpret)


# --------------------------------------------------------------------------- #
# Launch configuration
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class LaunchConfig:
    BM: int
    BN: int
    BK: int
    tile_group: bool
    num_warps: int = 4

    @property
    def name(self) -> str:
        return f"BM{self.BM}-BN{self.BN}-BK{self.BK}{'-tile' if self.tile_group else '-gidx'}"


# (BM, BN, BK, num_warps) per M bucket. Chosen from gfx1100 AOT compiles (see
# test_gptq_aot.py): BK=64 or 4 warps at BM>=32 spill VGPRs on RDNA3; these do not.
_BUCKETS = ((16, 64, 32, 4), (32, 64, 32, 8), (64, 64, 32, 8))
M_BUCKETS = tuple(b[0] for b in _BUCKETS)  # the self-check runs one M per bucket


def pick_config(m: int, group_size: int, has_gidx: bool) -> LaunchConfig:
    """group_size is the effective one (K for channel-wise)."""
    bm, bn, bk, nw = next((b for b in _BUCKETS if m <= b[0]), _BUCKETS[-1])
    tile = (not has_gidx) and group_size % bk == 0
    return LaunchConfig(BM=bm, BN=bn, BK=bk, tile_group=tile, num_warps=nw)


def gptq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    fmt: str,
    *,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """x [..., K] @ GPTQ weights. g_idx=None: groups are k // group_size.
    group_size <= 0 means one group over K. CPU tensors run in the interpreter."""
    x2 = x.reshape(-1, x.shape[-1])
    M, K = x2.shape
    N = qweight.shape[1]
    gs = K if group_size <= 0 else group_size
    has_gidx = g_idx is not None
    cfg = config or pick_config(M, gs, has_gidx)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    interpret = interpreting()
    if x.device.type == "cpu" and not interpret:
        raise RuntimeError("Triton GPTQ kernel on CPU tensors needs TRITON_INTERPRET=1 at process start")
    gidx = g_idx if has_gidx else qweight  # unused pointer when HAS_GIDX=False
    grid = (triton.cdiv(M, cfg.BM), triton.cdiv(N, cfg.BN))
    gptq_gemm_kernel[grid](
        x2,
        qweight,
        qzeros,
        scales,
        gidx,
        out,
        M,
        N,
        K,
        gs,
        x2.stride(0),
        x2.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        qzeros.stride(0),
        qzeros.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        out.stride(1),
        BITS=bits,
        ZOFF=1 if fmt == "v1" else 0,
        HAS_GIDX=has_gidx,
        TILE_GROUP=cfg.tile_group,
        # The interpreter returns garbage for a bf16 tl.dot (triton 3.8, measured): fp32 there.
        DOT_F32=interpret and x.dtype == torch.bfloat16,
        BM=cfg.BM,
        BN=cfg.BN,
        BK=cfg.BK,
        num_warps=cfg.num_warps,
    )
    return out.reshape(*x.shape[:-1], N)


# --------------------------------------------------------------------------- #
# Ahead-of-time compile for AMD (no GPU needed): ISA facts per variant
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class AotReport:
    variant: str
    arch: str
    wmma: tuple[str, ...]
    vgpr: int
    sgpr: int
    vgpr_spill: int
    sgpr_spill: int
    lds_bytes: int
    scratch_bytes: int

    @property
    def spills(self) -> int:
        return self.vgpr_spill + self.sgpr_spill


_TL_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _meta(asm: str, key: str) -> int:
    found = re.findall(rf"\.{key}:\s+(\d+)", asm)
    return int(found[0]) if found else 0


def aot_compile(
    bits: int, dtype: torch.dtype, cfg: LaunchConfig, *, fmt: str = "v1", has_gidx: bool = False, arch: str = "gfx1100"
) -> AotReport:
    """Compile one variant for `arch` and read the AMDGPU metadata of the result."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting():
        raise RuntimeError("AOT compile is impossible in a TRITON_INTERPRET=1 process")

    dt = _TL_DTYPE[dtype]
    sig = {
        "x_ptr": f"*{dt}",
        "qw_ptr": "*i32",
        "qz_ptr": "*i32",
        "s_ptr": f"*{dt}",
        "gidx_ptr": "*i32",
        "out_ptr": f"*{dt}",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "group_size": "i32",
        **{s: "i32" for s in ("sxm", "sxk", "sqk", "sqn", "szg", "szn", "ssg", "ssn", "som", "son")},
    }
    const = {
        "BITS": bits,
        "ZOFF": 1 if fmt == "v1" else 0,
        "HAS_GIDX": has_gidx,
        "TILE_GROUP": cfg.tile_group,
        "DOT_F32": False,
        "BM": cfg.BM,
        "BN": cfg.BN,
        "BK": cfg.BK,
    }
    sig.update({k: "constexpr" for k in const})
    compiled = triton.compile(
        ASTSource(gptq_gemm_kernel, sig, constexprs=const),
        target=GPUTarget("hip", arch, 32),
        options={"num_warps": cfg.num_warps},
    )
    asm = compiled.asm["amdgcn"]
    return AotReport(
        variant=f"b{bits}-{dt}-{'gidx' if has_gidx else 'seq'}-{cfg.name}",
        arch=arch,
        wmma=tuple(sorted(set(re.findall(r"v_wmma_\w+", asm)))),
        vgpr=_meta(asm, "vgpr_count"),
        sgpr=_meta(asm, "sgpr_count"),
        vgpr_spill=_meta(asm, "vgpr_spill_count"),
        sgpr_spill=_meta(asm, "sgpr_spill_count"),
        lds_bytes=_meta(asm, "group_segment_fixed_size"),
        scratch_bytes=_meta(asm, "private_segment_fixed_size"),
    )


def aot_variants() -> list[tuple[int, torch.dtype, LaunchConfig, bool]]:
    """(bits, dtype, config, has_gidx) for every launch config dispatch can pick for
    4-bit, and the decode config for 2/3/8-bit (group 128)."""
    out = []
    for dtype in (torch.float16, torch.bfloat16):
        for m in M_BUCKETS:
            for gidx in (False, True):
                out.append((4, dtype, pick_config(m, 128, gidx), gidx))
        for bits in (2, 3, 8):
            out.append((bits, dtype, pick_config(1, 128, False), False))
    return out


def aot_table(arch: str = "gfx1100") -> list[AotReport]:
    return [aot_compile(b, dt, cfg, has_gidx=g, arch=arch) for b, dt, cfg, g in aot_variants()]


if __name__ == "__main__":  # python -m sglang_l3.quant.gptq_triton [arch]
    import sys

    print(f"{'variant':44s} {'wmma':28s} {'vgpr':>4s} {'spill':>5s} {'scratch':>7s}")
    for r in aot_table(sys.argv[1] if len(sys.argv) > 1 else "gfx1100"):
        print(f"{r.variant:44s} {','.join(r.wmma) or 'NONE':28s} {r.vgpr:4d} {r.spills:5d} {r.scratch_bytes:7d}")
