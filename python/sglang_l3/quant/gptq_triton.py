"""Triton fused dequant-GEMM for GPTQ in the checkpoint layout (no shuffle), bits 2/3/4/8.

out[M, N] = x[M, K] @ W[K, N],  W[k, n] = (q[k, n] - zero[g, n]) * s[g, n],  g = g_idx[k]

Three kernels, chosen by M at call time from a per-architecture table (no autotune):
  gptq_gemv_kernel   M <= 4 (decode): no tl.dot. Each program owns a BN slice of
                     outputs and a slice of K; it loads each packed word once
                     ([BK/PER, BN] int32, PER values per word), unpacks it in
                     registers to [BK/PER, PER, BN], and reduces x * w with tl.sum
                     for each of its BM (1, 2 or 4) rows.
  gptq_gemm_kernel   tl.dot on [BM, BK] x [BK, BN] tiles; split over K (a third
                     grid axis) for M <= 16, whole K per program above that.
  splitk_reduce_kernel  the second pass of a split over K: the fp32 partial sums
                     [SPLIT, M, N] are added in split order and cast. Two passes,
                     not atomics: the result does not depend on the order in which
                     programs finish (bit-stable), at the cost of one small launch.
Two inner loops in each GEMM kernel, chosen at compile time:
  TILE_GROUP  no g_idx and BK divides the group: one scale/zero row per K tile,
              so the tile is x @ (q - z) (small integers, exact in fp16/bf16/fp32)
              and the scale is applied to the fp32 partial sum.
  g_idx       per-row group lookup (act-order shards whose groups are not
              contiguous tiles after sorting): dequantize then multiply.
The split over K cuts K into slices that are multiples of BK, so a tile never
straddles a slice (nor, with TILE_GROUP, a group).

No weight repack: the kernels read GPTQ's [K*bits/32, N] layout as loaded (the
GEMV kernel reads every packed word exactly once, coalesced along N). A
K-contiguous repack was not added because its gain could not be measured when
this was written (no GPU): see docs/rdna3.md.

On CPU tensors it runs under Triton's interpreter, which is a per-process mode
(TRITON_INTERPRET=1 before triton is imported: triton.language's own helpers are
wrapped at import). The same process can then not AOT-compile, so the tests run
interpreted checks in a child process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache

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


# M varies call to call (batch size): not specialized, one compile serves every M
@triton.jit(do_not_specialize=["M"])
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
    k_per,
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
    sos,
    BITS: tl.constexpr,
    ZOFF: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    TILE_GROUP: tl.constexpr,
    DOT_F32: tl.constexpr,
    PARTIAL: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Program (m tile, n tile, K slice). PARTIAL: out_ptr is the fp32 [SPLIT, M, N]
    buffer (slice stride sos), else the output (k_per = K, one slice)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)

    # zero points are packed along N: fixed positions for this N tile
    zbit = offs_n * BITS
    zword = zbit // 32
    zoff = zbit % 32

    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    for k0 in range(k_lo, k_hi, BK):
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

    omask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * sos + offs_m[:, None] * som + offs_n[None, :] * son, acc, mask=omask)
    else:
        tl.store(out_ptr + offs_m[:, None] * som + offs_n[None, :] * son, acc.to(out_ptr.dtype.element_ty), mask=omask)


# M varies call to call (batch size): not specialized, one compile serves every M
@triton.jit(do_not_specialize=["M"])
def gptq_gemv_kernel(
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
    k_per,
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
    sos,
    BITS: tl.constexpr,
    ZOFF: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    TILE_GROUP: tl.constexpr,
    PARTIAL: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    R: tl.constexpr,
    PER: tl.constexpr,
):
    """Program (n tile, K slice) for all M <= BM rows. A K tile is R rows of packed
    words, PER values each (PER = 32 // BITS; 1 for 3-bit, whose values straddle
    words): value k = k0 + r * PER + j sits at bit (k * BITS) % 32 of word
    (k * BITS) // 32, which for PER > 1 is word (k0 + r * PER) * BITS // 32."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    rows = tl.arange(0, R)
    cols = tl.arange(0, PER)
    # one accumulator per row of x, reduced over the R word rows only after the loop
    # (no cross-thread reduction inside it); the unused ones are compiled away
    acc0 = tl.zeros((R, BN), dtype=tl.float32)
    acc1 = tl.zeros((R, BN), dtype=tl.float32)
    acc2 = tl.zeros((R, BN), dtype=tl.float32)
    acc3 = tl.zeros((R, BN), dtype=tl.float32)

    zbit = offs_n * BITS
    zword = zbit // 32
    zoff = zbit % 32

    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    for k0 in range(k_lo, k_hi, R * PER):
        k_row = k0 + rows * PER  # [R] first value of each word row
        k2 = k_row[:, None] + cols[None, :]  # [R, PER]
        k_ok2 = k2 < K
        off = (k2 * BITS) % 32  # [R, PER]
        word = (k_row * BITS) // 32  # [R]
        wmask = (k_row < K)[:, None] & n_ok[None, :]  # [R, BN]
        w_lo = tl.load(qw_ptr + word[:, None] * sqk + offs_n[None, :] * sqn, mask=wmask, other=0)
        if BITS == 3:  # PER == 1: off is [R, 1]
            w_hi = tl.load(
                qw_ptr + (word + 1)[:, None] * sqk + offs_n[None, :] * sqn,
                mask=wmask & ((off + BITS) > 32),
                other=0,
            )
        else:
            w_hi = w_lo
        q = _extract(w_lo[:, None, :], w_hi[:, None, :], off[:, :, None], BITS)  # [R, PER, BN]

        if TILE_GROUP:
            g1 = k0 // group_size
            s1 = tl.load(s_ptr + g1 * ssg + offs_n * ssn, mask=n_ok, other=0.0).to(tl.float32)
            z1_lo = tl.load(qz_ptr + g1 * szg + zword * szn, mask=n_ok, other=0)
            if BITS == 3:
                z1_hi = tl.load(qz_ptr + g1 * szg + (zword + 1) * szn, mask=n_ok & ((zoff + BITS) > 32), other=0)
            else:
                z1_hi = z1_lo
            z1 = _extract(z1_lo, z1_hi, zoff, BITS) + ZOFF
            w = (q - z1[None, None, :]).to(tl.float32)  # small integers: exact
        else:
            g = tl.load(gidx_ptr + k2, mask=k_ok2, other=0) if HAS_GIDX else k2 // group_size  # [R, PER]
            gmask = k_ok2[:, :, None] & n_ok[None, None, :]
            s = tl.load(s_ptr + g[:, :, None] * ssg + offs_n[None, None, :] * ssn, mask=gmask, other=0.0)
            z_lo = tl.load(qz_ptr + g[:, :, None] * szg + zword[None, None, :] * szn, mask=gmask, other=0)
            if BITS == 3:
                z_hi = tl.load(
                    qz_ptr + g[:, :, None] * szg + (zword + 1)[None, None, :] * szn,
                    mask=gmask & ((zoff + BITS) > 32)[None, None, :],
                    other=0,
                )
            else:
                z_hi = z_lo
            z = _extract(z_lo, z_hi, zoff[None, None, :], BITS) + ZOFF
            w = (q - z).to(tl.float32) * s.to(tl.float32)

        for mi in tl.static_range(BM):
            xm = tl.load(x_ptr + mi * sxm + k2 * sxk, mask=k_ok2 & (mi < M), other=0.0).to(tl.float32)
            part = tl.sum(xm[:, :, None] * w, axis=1)  # [R, BN]
            if TILE_GROUP:
                part = part * s1[None, :]
            if mi == 0:
                acc0 += part
            elif mi == 1:
                acc1 += part
            elif mi == 2:
                acc2 += part
            else:
                acc3 += part

    base = out_ptr + pid_k * sos if PARTIAL else out_ptr
    for mi in tl.static_range(BM):
        if mi == 0:
            row = tl.sum(acc0, axis=0)
        elif mi == 1:
            row = tl.sum(acc1, axis=0)
        elif mi == 2:
            row = tl.sum(acc2, axis=0)
        else:
            row = tl.sum(acc3, axis=0)
        if not PARTIAL:
            row = row.to(out_ptr.dtype.element_ty)
        tl.store(base + mi * som + offs_n * son, row, mask=n_ok & (mi < M))


@triton.jit(do_not_specialize=["MN", "split"])
def splitk_reduce_kernel(part_ptr, out_ptr, MN, split, BLOCK: tl.constexpr):
    """out[i] = sum over s in 0..split-1, in that order, of part[s, i] (fp32), cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, split):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


REDUCE_BLOCK = 1024


def interpreting() -> bool:
    """TRITON_INTERPRET=1 was set before triton was imported (triton.language's own
    helpers are wrapped at import, so the mode is per process)."""
    return bool(triton.knobs.runtime.interpret)


# --------------------------------------------------------------------------- #
# Launch configuration
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class LaunchConfig:
    """One launch. kind "gemv": BM is the number of rows held per program (1, 2, 4)
    and BK = (BK // PER) word rows x PER values. split_k: programs along K (an
    upper bound: the launch uses cdiv(K, k_per) slices of k_per, a multiple of BK)."""

    BM: int
    BN: int
    BK: int
    tile_group: bool
    num_warps: int = 4
    split_k: int = 1
    kind: str = "dot"  # "dot" | "gemv"

    @property
    def name(self) -> str:
        split = f"-split{self.split_k}" if self.split_k > 1 else ""
        return f"{self.kind}-BM{self.BM}-BN{self.BN}-BK{self.BK}-w{self.num_warps}{split}{'-tile' if self.tile_group else '-gidx'}"


@dataclass(frozen=True)
class ArchTable:
    """The decode configs of one architecture. The split over K is derived from the
    shape: double it while the grid stays within programs_per_cu programs per compute
    unit, a K slice keeps at least min_k_split rows and split <= max_split."""

    gemv_max_m: int  # M <= this: the GEMV kernel
    gemv: tuple[int, int, int]  # (BN, BK, num_warps)
    splitk_max_m: int  # M <= this: tl.dot with a split over K
    splitk: tuple[int, int, int, int]  # (BM, BN, BK, num_warps)
    programs_per_cu: int
    min_k_split: int
    max_split: int
    cus: int  # compute units assumed when the device cannot be asked (CPU)


# Not measured yet (no GPU when they were written, issue 53): starting points from
# the kernels' structure and their AOT compiles (test_gptq_aot.py, Triton 3.8).
# sm90 (H200, 132 SMs): 64-column GEMV tiles of one g128 group, 4 warps (4-bit,
# sequential groups: 84 registers at 1 row, 168 at 2 or 4, no local memory; 8 warps
# took more), K split until ~8 programs per SM. gfx1100 (7900 XTX, wave32): every
# tile compiles spill-free (the GEMV BN64-BK64 with 4 warps spilled at 4 rows with
# g_idx, 8 warps does not); the split-K tl.dot tile is the old decode tile
# (BM16-BN64-BK32, 4 warps), the only dot tile that does not spill. "cpu" is the
# interpreter's (CPU tests): short slices so that small test layers reach the
# split-K path. benchmark/gptq_bench.py --sweep times alternatives on a GPU.
ARCH_TABLES: dict[str, ArchTable] = {
    "sm90": ArchTable(4, (64, 128, 4), 16, (16, 64, 32, 4), 8, 256, 16, 132),
    "gfx1100": ArchTable(4, (64, 64, 8), 16, (16, 64, 32, 4), 8, 256, 16, 96),
    "default": ArchTable(4, (64, 128, 4), 16, (16, 64, 32, 4), 8, 256, 16, 64),
    "cpu": ArchTable(4, (64, 32, 4), 16, (16, 64, 32, 4), 4, 32, 4, 2),
}

# (BM, BN, BK, num_warps) per M bucket above the split-K range. Chosen from gfx1100
# AOT compiles (see test_gptq_aot.py): BK=64 or 4 warps at BM>=32 spill VGPRs on
# RDNA3; these do not.
_BUCKETS = ((16, 64, 32, 4), (32, 64, 32, 8), (64, 64, 32, 8))
M_BUCKETS = tuple(b[0] for b in _BUCKETS)


@lru_cache(maxsize=16)
def arch_key(device: torch.device | str) -> str:
    """The ARCH_TABLES key of a device: "cpu"; an AMD gfx name (gfx11xx all read
    gfx1100's table); "sm<major><minor>" on NVIDIA; "default" when not in the table."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        return "default"
    if torch.version.hip is not None:
        name = torch.cuda.get_device_properties(device).gcnArchName.split(":", 1)[0]
        key = "gfx1100" if name.startswith("gfx11") else name
    else:
        major, minor = torch.cuda.get_device_capability(device)
        key = f"sm{major}{minor}"
    return key if key in ARCH_TABLES else "default"


@lru_cache(maxsize=16)
def compute_units(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return ARCH_TABLES["cpu"].cus


def values_per_word(bits: int) -> int:
    return 1 if 32 % bits else 32 // bits


def slices(K: int, bk: int, split: int) -> tuple[int, int]:
    """(slices actually launched, k_per): K cut into pieces of k_per rows, k_per a
    multiple of bk, at most `split` of them, none empty."""
    k_per = triton.cdiv(triton.cdiv(K, max(split, 1)), bk) * bk
    return triton.cdiv(K, k_per), k_per


def _split_for(tiles: int, K: int, bk: int, t: ArchTable, cus: int) -> int:
    target = t.programs_per_cu * cus
    split = 1
    while split * 2 <= t.max_split and tiles * split * 2 <= target and K // (split * 2) >= t.min_k_split:
        split *= 2
    return slices(K, bk, split)[0]


def _tile_bk(bk: int, group_size: int, has_gidx: bool, per: int) -> tuple[int, bool]:
    """(BK, TILE_GROUP): a K tile inside one group when the groups allow it (the
    largest power of two <= bk dividing the group, at least 32 and PER)."""
    if has_gidx:
        return bk, False
    b = bk
    while b >= max(32, per):
        if group_size % b == 0:
            return b, True
        b //= 2
    return bk, False


@lru_cache(maxsize=4096)
def pick_config(
    m: int,
    group_size: int,
    has_gidx: bool,
    *,
    K: int,
    N: int,
    bits: int = 4,
    arch: str = "default",
    cus: int | None = None,
) -> LaunchConfig:
    """The launch for M rows of a [K, N] layer on `arch` (an ARCH_TABLES key).
    group_size is the effective one (K for channel-wise). Pure and cached."""
    t = ARCH_TABLES.get(arch, ARCH_TABLES["default"])
    cus = cus or t.cus
    if m <= t.gemv_max_m:
        bn, bk, nw = t.gemv
        per = values_per_word(bits)
        # at most 32 word rows: BM accumulators of [BK / PER, BN] stay in registers
        bk, tile = _tile_bk(min(bk, 32 * per), group_size, has_gidx, per)
        split = _split_for(triton.cdiv(N, bn), K, bk, t, cus)
        bm = 1 << (max(m, 1) - 1).bit_length()  # 1, 2, 4
        return LaunchConfig(bm, bn, bk, tile, nw, split, "gemv")
    if m <= t.splitk_max_m:
        bm, bn, bk, nw = t.splitk
        bk, tile = _tile_bk(bk, group_size, has_gidx, 1)
        split = _split_for(triton.cdiv(m, bm) * triton.cdiv(N, bn), K, bk, t, cus)
        return LaunchConfig(bm, bn, bk, tile, nw, split, "dot")
    return legacy_config(m, group_size, has_gidx)


def legacy_config(m: int, group_size: int, has_gidx: bool) -> LaunchConfig:
    """The tl.dot kernel without a split over K: every M before issue 53, M > 16 now
    (benchmark/gptq_bench.py times it as "old" beside the decode path)."""
    bm, bn, bk, nw = next((b for b in _BUCKETS if m <= b[0]), _BUCKETS[-1])
    tile = (not has_gidx) and group_size % bk == 0
    return LaunchConfig(BM=bm, BN=bn, BK=bk, tile_group=tile, num_warps=nw)


def table_configs(arch: str, bits: int = 4, group_size: int = 128) -> list[tuple[int, LaunchConfig]]:
    """(M, config) for every decode config `arch`'s table can launch (GEMV at BM 1, 2,
    4; split-K tl.dot), forced to a split of 2, for checks on small layers."""
    t = ARCH_TABLES[arch]
    out: dict[LaunchConfig, int] = {}
    for m in range(1, t.splitk_max_m + 1):
        cfg = replace(pick_config(m, group_size, False, K=1 << 20, N=1, bits=bits, arch=arch), split_k=2)
        out.setdefault(cfg, m)
    return [(m, cfg) for cfg, m in out.items()]


# --------------------------------------------------------------------------- #
# Launch
# --------------------------------------------------------------------------- #
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
    arch: str | None = None,
) -> torch.Tensor:
    """x [..., K] @ GPTQ weights. g_idx=None: groups are k // group_size.
    group_size <= 0 means one group over K. CPU tensors run in the interpreter.
    config=None: pick_config for this M on `arch` (None: the device's)."""
    x2 = x.reshape(-1, x.shape[-1])
    M, K = x2.shape
    N = qweight.shape[1]
    gs = K if group_size <= 0 else group_size
    has_gidx = g_idx is not None
    interpret = interpreting()
    if x.device.type == "cpu" and not interpret:
        raise RuntimeError("Triton GPTQ kernel on CPU tensors needs TRITON_INTERPRET=1 at process start")
    if config is None:
        key = arch or arch_key(x.device)
        cus = compute_units(x.device) if key != "cpu" else None
        config = pick_config(M, gs, has_gidx, K=K, N=N, bits=bits, arch=key, cus=cus)
    cfg = config
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*x.shape[:-1], N)
    split, k_per = slices(K, cfg.BK, cfg.split_k)
    if split > 1:
        dst = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        sos, som, son = dst.stride(0), dst.stride(1), dst.stride(2)
    else:
        dst, sos, som, son = out, 0, out.stride(0), out.stride(1)
    gidx = g_idx if has_gidx else qweight  # unused pointer when HAS_GIDX=False
    args = (
        x2,
        qweight,
        qzeros,
        scales,
        gidx,
        dst,
        M,
        N,
        K,
        gs,
        k_per,
        x2.stride(0),
        x2.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        qzeros.stride(0),
        qzeros.stride(1),
        scales.stride(0),
        scales.stride(1),
        som,
        son,
        sos,
    )
    common = dict(BITS=bits, ZOFF=1 if fmt == "v1" else 0, HAS_GIDX=has_gidx, TILE_GROUP=cfg.tile_group)
    if cfg.kind == "gemv":
        if M > cfg.BM or cfg.BM > 4:
            raise ValueError(f"GEMV config {cfg.name} holds {cfg.BM} rows (at most 4), M={M}")
        per = values_per_word(bits)
        gemv_grid = (triton.cdiv(N, cfg.BN), split)
        gptq_gemv_kernel[gemv_grid](
            *args, **common, PARTIAL=split > 1, BM=cfg.BM, BN=cfg.BN, R=cfg.BK // per, PER=per, num_warps=cfg.num_warps
        )
    else:
        dot_grid = (triton.cdiv(M, cfg.BM), triton.cdiv(N, cfg.BN), split)
        gptq_gemm_kernel[dot_grid](
            *args,
            **common,
            # The interpreter returns garbage for a bf16 tl.dot (triton 3.8, measured): fp32 there.
            DOT_F32=interpret and x.dtype == torch.bfloat16,
            PARTIAL=split > 1,
            BM=cfg.BM,
            BN=cfg.BN,
            BK=cfg.BK,
            num_warps=cfg.num_warps,
        )
    if split > 1:
        splitk_reduce_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](dst, out, M * N, split, BLOCK=REDUCE_BLOCK)
    return out.reshape(*x.shape[:-1], N)


# --------------------------------------------------------------------------- #
# Ahead-of-time compile (no GPU needed): register facts per variant, AMD or NVIDIA
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
_STRIDES = ("sxm", "sxk", "sqk", "sqn", "szg", "szn", "ssg", "ssn", "som", "son", "sos")


def _meta(asm: str, key: str) -> int:
    found = re.findall(rf"\.{key}:\s+(\d+)", asm)
    return int(found[0]) if found else 0


def _amd_report(variant: str, arch: str, asm: str) -> AotReport:
    return AotReport(
        variant=variant,
        arch=arch,
        wmma=tuple(sorted(set(re.findall(r"v_wmma_\w+", asm)))),
        vgpr=_meta(asm, "vgpr_count"),
        sgpr=_meta(asm, "sgpr_count"),
        vgpr_spill=_meta(asm, "vgpr_spill_count"),
        sgpr_spill=_meta(asm, "sgpr_spill_count"),
        lds_bytes=_meta(asm, "group_segment_fixed_size"),
        scratch_bytes=_meta(asm, "private_segment_fixed_size"),
    )


def _cuda_report(variant: str, arch: str, cubin: bytes) -> AotReport:
    """Registers, local memory (spills land there) and shared memory of a cubin, from
    the cuobjdump bundled with triton's NVIDIA backend; wmma lists the tensor-core
    PTX instructions (mma / wgmma)."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout

    def field(key: str) -> int:
        found = re.findall(rf"\b{key}:(\d+)", usage)
        return int(found[0]) if found else 0

    return AotReport(variant, arch, (), field("REG"), 0, 0, 0, field("SHARED"), field("LOCAL"))


def _compile(fn, sig: dict[str, str], const: dict[str, object], arch: str, num_warps: int, variant: str) -> AotReport:
    """Compile for an AMD gfx name (wave32) or an NVIDIA "sm<cc>" without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting():
        raise RuntimeError("AOT compile is impossible in a TRITON_INTERPRET=1 process")
    sig = {**sig, **{k: "constexpr" for k in const}}
    src = ASTSource(fn, sig, constexprs=const)
    if arch.startswith("sm"):
        compiled = triton.compile(src, target=GPUTarget("cuda", int(arch[2:]), 32), options={"num_warps": num_warps})
        report = _cuda_report(variant, arch, compiled.asm["cubin"])
        mma = tuple(sorted(set(re.findall(r"\b(wgmma\.\w+|mma\.sync)", str(compiled.asm["ptx"])))))
        return replace(report, wmma=mma)
    compiled = triton.compile(src, target=GPUTarget("hip", arch, 32), options={"num_warps": num_warps})
    return _amd_report(variant, arch, str(compiled.asm["amdgcn"]))


def aot_compile(
    bits: int,
    dtype: torch.dtype,
    cfg: LaunchConfig,
    *,
    fmt: str = "v1",
    has_gidx: bool = False,
    arch: str = "gfx1100",
    partial: bool | None = None,
) -> AotReport:
    """Compile one variant for `arch` (gfx name or "sm<cc>") and read its register use.
    partial=None: the split-K store exactly when cfg.split_k > 1."""
    dt = _TL_DTYPE[dtype]
    partial = cfg.split_k > 1 if partial is None else partial
    sig = {
        "x_ptr": f"*{dt}",
        "qw_ptr": "*i32",
        "qz_ptr": "*i32",
        "s_ptr": f"*{dt}",
        "gidx_ptr": "*i32",
        "out_ptr": "*fp32" if partial else f"*{dt}",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "group_size": "i32",
        "k_per": "i32",
        **{s: "i32" for s in _STRIDES},
    }
    const: dict[str, object] = {
        "BITS": bits,
        "ZOFF": 1 if fmt == "v1" else 0,
        "HAS_GIDX": has_gidx,
        "TILE_GROUP": cfg.tile_group,
    }
    if cfg.kind == "gemv":
        per = values_per_word(bits)
        const.update(PARTIAL=partial, BM=cfg.BM, BN=cfg.BN, R=cfg.BK // per, PER=per)
        fn = gptq_gemv_kernel
    else:
        const.update(DOT_F32=False, PARTIAL=partial, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK)
        fn = gptq_gemm_kernel
    return _compile(fn, sig, const, arch, cfg.num_warps, f"b{bits}-{dt}-{'gidx' if has_gidx else 'seq'}-{cfg.name}")


def aot_compile_reduce(dtype: torch.dtype, arch: str = "gfx1100") -> AotReport:
    dt = _TL_DTYPE[dtype]
    sig = {"part_ptr": "*fp32", "out_ptr": f"*{dt}", "MN": "i32", "split": "i32"}
    return _compile(splitk_reduce_kernel, sig, {"BLOCK": REDUCE_BLOCK}, arch, 4, f"reduce-{dt}")


def aot_variants(arch: str = "gfx1100") -> list[tuple[int, torch.dtype, LaunchConfig, bool]]:
    """(bits, dtype, config, has_gidx) for every launch config dispatch can pick for
    4-bit on `arch` (the decode configs of its table with a split over K, each M
    bucket above them), and the decode configs for 2/3/8-bit (group 128)."""
    decode = [cfg for _, cfg in table_configs(arch)]
    big = [legacy_config(m, 128, False) for m in M_BUCKETS]
    out = []
    for dtype in (torch.float16, torch.bfloat16):
        for cfg in decode + big:
            for gidx in (False, True):
                c = replace(cfg, tile_group=False) if gidx else cfg
                out.append((4, dtype, c, gidx))
        for bits in (2, 3, 8):
            for _, cfg in table_configs(arch, bits):
                if cfg.kind == "gemv" and cfg.BM != 1:
                    continue  # BM only repeats the per-row reduction
                out.append((bits, dtype, cfg, False))
    return out


def aot_table(arch: str = "gfx1100") -> list[AotReport]:
    """Every variant of aot_variants(arch) compiled for arch (a gfx name or "sm<cc>")."""
    reports = [aot_compile(b, dt, cfg, has_gidx=g, arch=arch) for b, dt, cfg, g in aot_variants(arch)]
    return reports + [aot_compile_reduce(dt, arch) for dt in _TL_DTYPE]


if __name__ == "__main__":  # python -m sglang_l3.quant.gptq_triton [arch]
    import sys

    print(f"{'variant':60s} {'wmma':28s} {'vgpr':>4s} {'spill':>5s} {'scratch':>7s}")
    for r in aot_table(sys.argv[1] if len(sys.argv) > 1 else "gfx1100"):
        print(f"{r.variant:60s} {','.join(r.wmma) or 'NONE':28s} {r.vgpr:4d} {r.spills:5d} {r.scratch_bytes:7d}")
