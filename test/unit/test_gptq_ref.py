"""GPTQ checkpoint format: packer, reference dequantizer, v1/v2 detection, act-order sort,
ExLlama shuffle, and the torch last-resort kernel, for every supported combination."""

from __future__ import annotations

import itertools

import pytest
import torch
from sglang_l3.quant import gptq_ref as R

BITS = (2, 3, 4, 8)
DTYPES = (torch.float16, torch.bfloat16)
# (group_size, act_order): grouped, grouped + act-order, channel-wise
GROUPS = ((32, False), (64, True), (-1, False))
K, N = 256, 96  # N=96: 3-bit zeros pack in 32-column units


def _layer(bits, gs, act, sym, fmt, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(K, N, generator=g) * 0.05
    return R.quantize(w, bits, gs, sym=sym, act_order=act, fmt=fmt, scale_dtype=dtype, seed=seed)


COMBOS = list(itertools.product(BITS, GROUPS, (True, False), ("v1", "v2"), DTYPES))


def _id(c):
    bits, (gs, act), sym, fmt, dt = c
    return f"b{bits}-g{gs}{'-act' if act else ''}-{'sym' if sym else 'asym'}-{fmt}-{str(dt)[6:]}"


@pytest.mark.parametrize("bits", BITS)
def test_pack_layout_is_the_checkpoint_bitstream(bits: int) -> None:
    """Element r of a column sits at bits [r*bits, (r+1)*bits) of that column's
    little-endian int32 stream (straddling words for 3-bit)."""
    g = torch.Generator().manual_seed(bits)
    vals = torch.randint(0, 1 << bits, (96, 5), generator=g)
    packed = R.pack_rows(vals, bits)
    assert packed.dtype == torch.int32 and packed.shape == (96 * bits // 32, 5)
    words = (packed.to(torch.int64) & 0xFFFFFFFF).tolist()
    for c in range(5):
        stream = sum(words[w][c] << (32 * w) for w in range(len(words)))
        for r in range(96):
            assert (stream >> (r * bits)) & ((1 << bits) - 1) == vals[r, c].item()
    assert torch.equal(R.unpack_rows(packed, bits), vals.to(torch.int32))
    cols = R.pack_cols(vals.t().contiguous(), bits)
    assert torch.equal(cols, packed.t().contiguous())
    assert torch.equal(R.unpack_cols(cols, bits), vals.t().to(torch.int32))


@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_reference_dequant_reproduces_the_quantized_weights(combo) -> None:
    bits, (gs, act), sym, fmt, dtype = combo
    L = _layer(bits, gs, act, sym, fmt, dtype)
    assert L.qweight.shape == (K * bits // 32, N)
    G = 1 if gs == -1 else K // gs
    assert L.qzeros.shape == (G, N * bits // 32) and L.scales.shape == (G, N)
    assert torch.equal(R.unpack_rows(L.qweight, bits), L.q)
    assert torch.equal(R.zero_points(L.qzeros, bits, fmt), L.zeros)
    w = R.dequantize(L.qweight, L.qzeros, L.scales, L.g_idx, bits, fmt)
    torch.testing.assert_close(w, L.w, rtol=0, atol=0)


@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_torch_kernel_matches_reference_and_negative_controls_are_caught(combo) -> None:
    """The last-resort runtime kernel (dequantize to the activation dtype + matmul)
    is within output-dtype rounding; reading the zeros in the other format, or
    ignoring g_idx of an act-order layer, is not."""
    bits, (gs, act), sym, fmt, dtype = combo
    L = _layer(bits, gs, act, sym, fmt, dtype, seed=1)
    x = R.check_inputs(5, K, dtype, "cpu")
    ref = R.reference_matmul(x, L.qweight, L.qzeros, L.scales, L.g_idx, bits, fmt)
    torch.testing.assert_close(ref, x.float() @ L.w, rtol=1e-5, atol=1e-3)
    good = R.compare(R.torch_gemm(x, L.qweight, L.qzeros, L.scales, L.g_idx, bits, fmt), ref, dtype)
    assert good.ok, good
    other = "v2" if fmt == "v1" else "v1"
    bad = R.compare(R.torch_gemm(x, L.qweight, L.qzeros, L.scales, L.g_idx, bits, other), ref, dtype)
    assert not bad.ok, f"wrong zero format not detected: {bad}"
    if act:
        seq = torch.arange(K, dtype=torch.int32) // gs
        bad = R.compare(R.torch_gemm(x, L.qweight, L.qzeros, L.scales, seq, bits, fmt), ref, dtype)
        assert not bad.ok, f"ignored g_idx not detected: {bad}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stored,declared", [("v1", "v1"), ("v2", "v2"), ("v2", "v1"), ("v1", "v2")])
def test_symmetric_zero_format_is_detected_from_the_stored_zeros(bits, stored, declared) -> None:
    L = _layer(bits, 64, False, True, stored, torch.float16)
    d = R.detect_zero_format(L.qzeros, bits, declared)
    assert d.fmt == stored and d.symmetric
    assert ("overridden" in d.reason) == (stored != declared)
    # the misdeclared checkpoint read with its declared format is garbage, and caught
    x = R.check_inputs(3, K, torch.float16, "cpu")
    ref = x.float() @ L.w
    assert R.compare(R.reference_matmul(x, L.qweight, L.qzeros, L.scales, L.g_idx, bits, d.fmt), ref, torch.float16).ok
    if stored != declared:
        assert not R.compare(
            R.reference_matmul(x, L.qweight, L.qzeros, L.scales, L.g_idx, bits, declared), ref, torch.float16
        ).ok


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("declared", ["v1", "v2"])
def test_asymmetric_zeros_keep_the_declared_format(bits, declared) -> None:
    L = _layer(bits, 32, False, False, declared, torch.float16)
    d = R.detect_zero_format(L.qzeros, bits, declared)
    assert d.fmt == declared and not d.symmetric


def test_qwen_int4_v1_label_with_v2_zeros() -> None:
    """The case from vLLM #38966: checkpoint_format 'gptq', qzeros 0x88888888."""
    L = _layer(4, 128, False, True, "v2", torch.float16)
    assert (L.qzeros == 0x88888888 - 2**32).all()
    assert R.detect_zero_format(L.qzeros, 4, "v1").fmt == "v2"


def test_zero_format_conversion() -> None:
    L = _layer(4, 32, False, False, "v2", torch.float16)
    z = R.zero_points(L.qzeros, 4, "v2")
    if (z == 0).any():
        with pytest.raises(ValueError, match="cannot be represented"):
            R.convert_zero_format(L.qzeros, 4, "v2", "v1")
    S = _layer(4, 32, False, True, "v2", torch.float16)
    v1 = R.convert_zero_format(S.qzeros, 4, "v2", "v1")
    assert torch.equal(R.zero_points(v1, 4, "v1"), R.zero_points(S.qzeros, 4, "v2"))
    zero0 = R.encode_zeros(torch.zeros(2, 8, dtype=torch.int32), 4, "v2")
    with pytest.raises(ValueError):
        R.convert_zero_format(zero0, 4, "v2", "v1")


@pytest.mark.parametrize("bits", BITS)
def test_act_order_sort_is_exact(bits: int) -> None:
    L = _layer(bits, 64, True, False, "v2", torch.float16)
    assert not R.is_sequential(L.g_idx, 64)
    qw, g, perm = R.sort_by_group(L.qweight, L.g_idx, bits)
    assert R.is_sequential(g, 64), "a full-K act-order layer sorts into k // group_size"
    x = torch.randn(4, K, dtype=torch.float64)
    w0 = R.dequantize(L.qweight, L.qzeros, L.scales, L.g_idx, bits, "v2").double()
    w1 = R.dequantize(qw, L.qzeros, L.scales, g, bits, "v2").double()
    torch.testing.assert_close(x[:, perm] @ w1, x @ w0, rtol=1e-12, atol=1e-12)


def test_exllama_shuffle_layout() -> None:
    """Nibble j of a shuffled word holds element (0,2,4,6,1,3,5,7)[j] (ExLlama's
    '77775555 33331111 66664444 22220000'), and the shuffle is a bijection."""
    vals = torch.arange(8).repeat(4, 1).t().contiguous()  # column c: elements 0..7
    word = R.pack_rows(vals, 4)  # one int32 per column
    s = R.exllama_shuffle_4bit(word)
    nib = [(s[0, 0].item() & 0xFFFFFFFF) >> (4 * j) & 0xF for j in range(8)]
    assert nib == [0, 2, 4, 6, 1, 3, 5, 7]
    g = torch.Generator().manual_seed(3)
    q = R.pack_rows(torch.randint(0, 16, (64, 16), generator=g), 4)
    assert torch.equal(R.exllama_unshuffle_4bit(R.exllama_shuffle_4bit(q)), q)
    assert not torch.equal(R.exllama_shuffle_4bit(q), q)


def test_unsupported_bits_are_refused() -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        R.pack_rows(torch.zeros(32, 2, dtype=torch.int64), 5)
    with pytest.raises(ValueError, match="multiple"):
        R.quantize(torch.randn(100, 8), 4, 64)
