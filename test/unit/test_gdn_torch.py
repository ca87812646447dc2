"""Numerics of the torch-native CPU serving kernels (sglang_l3.cpu_serving).

The reference is the Gated-DeltaNet rule written out token by token, head by
head, in float64 — nothing shared with the code under test. fp32 results must
match it to fp32 tolerance; the properties L3 restores rely on (a prefix
restored from a chunk state continues bit-for-bit, a sequence's result does not
depend on its batch) are checked with exact equality.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from sglang_l3.cpu_serving import conv1d, gdn, ops, weights

H, HV, K, V = 2, 4, 32, 16  # two value heads per qk head; K != V catches transposes
ATOL = 2e-5


# --------------------------------------------------------------------------- #
# reference: the rule, one token and one head at a time, float64
# --------------------------------------------------------------------------- #
def reference_rule(q, k, v, g, beta, state):
    """q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; state [HV, V, K].
    Returns (o [T, HV, V], states after each token [T, HV, V, K])."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    S = state.double().clone()
    T = q.shape[0]
    rep = HV // H
    o = torch.zeros(T, HV, V, dtype=torch.float64)
    after = torch.zeros(T, HV, V, K, dtype=torch.float64)
    for t in range(T):
        for h in range(HV):
            qh = q[t, h // rep] / math.sqrt(float((q[t, h // rep] ** 2).sum()) + 1e-6)
            kh = k[t, h // rep] / math.sqrt(float((k[t, h // rep] ** 2).sum()) + 1e-6)
            qh = qh * K**-0.5
            S[h] = S[h] * math.exp(float(g[t, h]))
            S[h] = S[h] + float(beta[t, h]) * torch.outer(v[t, h] - S[h] @ kh, kh)
            o[t, h] = S[h] @ qh
        after[t] = S
    return o, after


def reference_gating(A_log, a, b, dt_bias):
    x = a.double() + dt_bias.double()
    softplus = torch.where(x <= 20.0, torch.log1p(torch.exp(x)), x)
    return -torch.exp(A_log.double()) * softplus, torch.sigmoid(b.double())


def _inputs(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    a = torch.randn(T, HV, generator=gen)
    b = torch.randn(T, HV, generator=gen)
    A_log = torch.rand(HV, generator=gen) * 0.5 - 1.0  # mild decay: state matters
    dt_bias = torch.rand(HV, generator=gen) - 2.0
    g, beta = gdn.gdn_gating(A_log, a, b, dt_bias)
    return q, k, v, a, b, A_log, dt_bias, g, beta


def _pool(n_slots=6, seed=1):
    return torch.randn(n_slots, HV, V, K, generator=torch.Generator().manual_seed(seed)) * 0.1


# --------------------------------------------------------------------------- #
# gating
# --------------------------------------------------------------------------- #
def test_gating_matches_formula():
    q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(50)
    a = a * 15  # crosses the softplus threshold
    g, beta = gdn.gdn_gating(A_log, a, b, dt_bias)
    rg, rb = reference_gating(A_log, a, b, dt_bias)
    assert g.shape == beta.shape == (1, 50, HV)
    assert g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g[0].double(), rg, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta[0].double(), rb, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- #
# chunked prefill
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("lens", [[1], [64], [37, 5, 130], [200, 64, 65]])
def test_chunked_prefill_matches_recurrent_reference(lens):
    T = sum(lens)
    q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(T)
    pool = _pool()
    slots = [5, 2, 0][: len(lens)]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    work = pool.clone()
    o, none, h = gdn.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=work,
        initial_state_indices=torch.tensor(slots),
        cu_seqlens=cu,
    )
    assert none is None and o.shape == (1, T, HV, V) and o.dtype == q.dtype
    assert h.dtype == torch.float32  # chunk states stay fp32 (exact restores)
    assert h.shape == (1, sum((n - 1) // 64 + 1 for n in lens), HV, V, K)
    hi = 0
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        ro, after = reference_rule(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], pool[slots[i]])
        torch.testing.assert_close(o[0, s:e].double(), ro, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(work[slots[i]].double(), after[-1], atol=ATOL, rtol=1e-4)
        # h[c] = state before chunk c = after 64*c tokens of this sequence
        for c in range((e - s - 1) // 64 + 1):
            expect = pool[slots[i]].double() if c == 0 else after[64 * c - 1]
            torch.testing.assert_close(h[0, hi].double(), expect, atol=ATOL, rtol=1e-4)
            hi += 1
    untouched = [x for x in range(pool.shape[0]) if x not in slots]
    assert torch.equal(work[untouched], pool[untouched])


def test_prefill_padding_row_is_skipped():
    q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(20)
    pool = _pool()
    work = pool.clone()
    o, _, h = gdn.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=work,
        initial_state_indices=torch.tensor([3, -1]),
        cu_seqlens=torch.tensor([0, 12, 20]),
    )
    assert torch.equal(o[0, 12:], torch.zeros_like(o[0, 12:]))
    assert h.shape[1] == 2
    assert torch.equal(work[[0, 1, 2, 4, 5]], pool[[0, 1, 2, 4, 5]])


def test_inplace_update_false_leaves_pool():
    q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(30)
    pool = _pool()
    work = pool.clone()
    gdn.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=work,
        initial_state_indices=torch.tensor([1]),
        cu_seqlens=torch.tensor([0, 30]),
        inplace_update=False,
    )
    assert torch.equal(work, pool)


def test_restore_from_chunk_state_continues_bit_exact():
    """What an L3 restore does: prefill 0..400 once; later restore the chunk state
    at 384 (h[6]) into another slot and prefill 384..400 — identical bits."""
    q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(400)
    pool = _pool()
    full = pool.clone()
    o_full, _, h = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=full, initial_state_indices=torch.tensor([1]), cu_seqlens=torch.tensor([0, 400])
    )
    restored = pool.clone()
    restored[4] = h[0, 6].to(restored.dtype)
    sl = slice(384, 400)
    o_tail, _, _ = gdn.chunk_gated_delta_rule(
        q[:, sl],
        k[:, sl],
        v[:, sl],
        g[:, sl],
        beta[:, sl],
        initial_state=restored,
        initial_state_indices=torch.tensor([4]),
        cu_seqlens=torch.tensor([0, 16]),
    )
    assert torch.equal(o_tail, o_full[:, sl])
    assert torch.equal(restored[4], full[1])


def test_sequence_result_does_not_depend_on_its_batch():
    q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(300)
    pool = _pool()
    alone = pool.clone()
    o_alone, _, h_alone = gdn.chunk_gated_delta_rule(
        q[:, 100:],
        k[:, 100:],
        v[:, 100:],
        g[:, 100:],
        beta[:, 100:],
        initial_state=alone,
        initial_state_indices=torch.tensor([2]),
        cu_seqlens=torch.tensor([0, 200]),
    )
    batched = pool.clone()
    o_b, _, h_b = gdn.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=batched,
        initial_state_indices=torch.tensor([0, 2]),
        cu_seqlens=torch.tensor([0, 100, 300]),
    )
    assert torch.equal(o_b[:, 100:], o_alone)
    assert torch.equal(batched[2], alone[2])
    assert torch.equal(h_b[0, 2:], h_alone[0])


def test_matches_transformers_reference_if_installed():
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(150)
    pool = _pool()
    work = pool.clone()
    o, _, _ = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=work, initial_state_indices=torch.tensor([3]), cu_seqlens=torch.tensor([0, 150])
    )
    rep = HV // H
    ro, rs = hf.torch_chunk_gated_delta_rule(
        q.repeat_interleave(rep, 2),
        k.repeat_interleave(rep, 2),
        v,
        g,
        beta,
        initial_state=pool[3].transpose(-1, -2).unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o, ro.to(o.dtype), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(work[3], rs[0].transpose(-1, -2), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- #
# recurrent decode
# --------------------------------------------------------------------------- #
def test_decode_matches_recurrent_reference():
    pool = _pool()
    work = pool.clone()
    ref = pool.double().clone()
    slots = torch.tensor([4, -1, 1])  # a padding row in the middle
    for step in range(4):
        q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(3, seed=10 + step)
        o = gdn.sigmoid_gating_delta_rule_update(
            A_log=A_log,
            dt_bias=dt_bias,
            q=q,
            k=k,
            v=v,
            a=a,
            b=b,
            initial_state_source=work,
            initial_state_indices=slots,
            cu_seqlens=torch.arange(4),
        )
        rg, rb = reference_gating(A_log, a, b, dt_bias)
        for row, slot in enumerate(slots.tolist()):
            if slot < 0:
                assert torch.equal(o[0, row], torch.zeros_like(o[0, row]))
                continue
            ro, after = reference_rule(
                q[0, row : row + 1],
                k[0, row : row + 1],
                v[0, row : row + 1],
                rg[row : row + 1],
                rb[row : row + 1],
                ref[slot],
            )
            ref[slot] = after[-1]
            torch.testing.assert_close(o[0, row].double(), ro[0], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(work.double(), ref, atol=ATOL, rtol=1e-4)


def test_prefill_then_decode_equals_one_prefill():
    q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(70)
    pool = _pool()
    one = pool.clone()
    o_one, _, _ = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=one, initial_state_indices=torch.tensor([0]), cu_seqlens=torch.tensor([0, 70])
    )
    two = pool.clone()
    o_pre, _, _ = gdn.chunk_gated_delta_rule(
        q[:, :66],
        k[:, :66],
        v[:, :66],
        g[:, :66],
        beta[:, :66],
        initial_state=two,
        initial_state_indices=torch.tensor([0]),
        cu_seqlens=torch.tensor([0, 66]),
    )
    outs = [o_pre]
    for t in range(66, 70):
        outs.append(
            gdn.recurrent_gated_delta_rule(
                q[:, t : t + 1],
                k[:, t : t + 1],
                v[:, t : t + 1],
                g[:, t : t + 1],
                beta[:, t : t + 1],
                initial_state=two,
                initial_state_indices=torch.tensor([0]),
                cu_seqlens=torch.tensor([0, 1]),
            )
        )
    torch.testing.assert_close(torch.cat(outs, 1), o_one, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(two, one, atol=ATOL, rtol=1e-4)


def test_decode_step_does_not_depend_on_its_batch():
    pool = _pool()
    q, k, v, a, b, A_log, dt_bias, g, beta = _inputs(3, seed=5)
    batched = pool.clone()
    ob = gdn.recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=batched,
        initial_state_indices=torch.tensor([0, 1, 2]),
        cu_seqlens=torch.arange(4),
    )
    alone = pool.clone()
    oa = gdn.recurrent_gated_delta_rule(
        q[:, 1:2],
        k[:, 1:2],
        v[:, 1:2],
        g[:, 1:2],
        beta[:, 1:2],
        initial_state=alone,
        initial_state_indices=torch.tensor([1]),
        cu_seqlens=torch.arange(2),
    )
    assert torch.equal(ob[:, 1:2], oa) and torch.equal(batched[1], alone[1])


# --------------------------------------------------------------------------- #
# causal conv1d
# --------------------------------------------------------------------------- #
DIM, W = 24, 4


def _conv_ref(x, w, bias):
    return F.silu(
        F.conv1d(x.double()[None], w.double()[:, None], bias.double(), padding=W - 1, groups=DIM)[0, :, : x.shape[1]]
    )


def test_conv_prefill_matches_conv1d():
    gen = torch.Generator().manual_seed(3)
    w, bias, x = (
        torch.randn(DIM, W, generator=gen),
        torch.randn(DIM, generator=gen),
        torch.randn(DIM, 40, generator=gen),
    )
    states = torch.zeros(3, DIM, W - 1)
    out = conv1d.causal_conv1d_fn(
        x,
        w,
        bias,
        states,
        torch.tensor([0, 15, 40]),
        cache_indices=torch.tensor([0, 2]),
        has_initial_state=torch.tensor([False, False]),
        activation="silu",
    )
    torch.testing.assert_close(out[:, :15].double(), _conv_ref(x[:, :15], w, bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, 15:].double(), _conv_ref(x[:, 15:], w, bias), atol=1e-5, rtol=1e-5)
    assert torch.equal(states[2], x[:, -(W - 1) :]) and torch.equal(states[1], torch.zeros(DIM, W - 1))


def test_conv_chunked_prefill_and_decode_are_bit_exact():
    gen = torch.Generator().manual_seed(4)
    w, bias, x = (
        torch.randn(DIM, W, generator=gen),
        torch.randn(DIM, generator=gen),
        torch.randn(DIM, 30, generator=gen),
    )
    s1 = torch.zeros(2, DIM, W - 1)
    whole = conv1d.causal_conv1d_fn(
        x, w, bias, s1, torch.tensor([0, 30]), cache_indices=torch.tensor([1]), has_initial_state=torch.tensor([False])
    )
    s2 = torch.zeros(2, DIM, W - 1)
    p1 = conv1d.causal_conv1d_fn(
        x[:, :2],
        w,
        bias,
        s2,
        torch.tensor([0, 2]),
        cache_indices=torch.tensor([1]),
        has_initial_state=torch.tensor([False]),
    )
    p2 = conv1d.causal_conv1d_fn(
        x[:, 2:26],
        w,
        bias,
        s2,
        torch.tensor([0, 24]),
        cache_indices=torch.tensor([1]),
        has_initial_state=torch.tensor([True]),
    )
    steps = [
        conv1d.causal_conv1d_update(x[None, :, t], s2, w, bias, "silu", conv_state_indices=torch.tensor([1]))[0]
        for t in range(26, 30)
    ]
    assert torch.equal(torch.cat([p1, p2, torch.stack(steps, 1)], 1), whole)
    assert torch.equal(s2, s1)
    torch.testing.assert_close(whole.double(), _conv_ref(x, w, bias), atol=1e-5, rtol=1e-5)


def test_conv_update_skips_padding_rows():
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(DIM, W, generator=gen), torch.randn(2, DIM, generator=gen)
    states = torch.randn(3, DIM, W - 1, generator=gen)
    before = states.clone()
    out = conv1d.causal_conv1d_update(x, states, w, None, "silu", conv_state_indices=torch.tensor([-1, 0]))
    assert torch.equal(out[0], torch.zeros(DIM)) and torch.equal(states[1:], before[1:])
    assert not torch.equal(states[0], before[0])


# --------------------------------------------------------------------------- #
# small ops
# --------------------------------------------------------------------------- #
def test_qkvzba_split_follows_upstream_layout():
    nqk, nv, hqk, hv, T = 2, 4, 3, 5, 7
    r = nv // nqk
    qkvz = torch.arange(T * nqk * (2 * hqk + 2 * r * hv), dtype=torch.float32).view(T, -1)
    ba = torch.arange(T * nqk * 2 * r, dtype=torch.float32).view(T, -1)
    mixed_qkv, z, b, a = ops.fused_qkvzba_split_reshape_cat(qkvz, ba, nqk, nv, hqk, hv)
    grp = qkvz.view(T, nqk, -1)
    q = grp[..., :hqk].reshape(T, -1)
    k = grp[..., hqk : 2 * hqk].reshape(T, -1)
    v = grp[..., 2 * hqk : 2 * hqk + r * hv].reshape(T, -1)
    assert torch.equal(mixed_qkv, torch.cat([q, k, v], -1))
    assert torch.equal(z, grp[..., 2 * hqk + r * hv :].reshape(T, nv, hv))
    bag = ba.view(T, nqk, 2 * r)
    assert torch.equal(b, bag[..., :r].reshape(T, nv)) and torch.equal(a, bag[..., r:].reshape(T, nv))


def test_rms_norm_gated():
    gen = torch.Generator().manual_seed(6)
    x, gate, weight = (
        torch.randn(5, 16, generator=gen),
        torch.randn(5, 16, generator=gen),
        torch.randn(16, generator=gen),
    )
    y = ops.rms_norm_gated(x.bfloat16(), gate.bfloat16(), weight, None, "silu", 1e-6)
    xd = x.bfloat16().double()
    ref = xd / torch.sqrt((xd**2).mean(-1, keepdim=True) + 1e-6) * weight.double() * F.silu(gate.bfloat16().double())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, atol=2e-2, rtol=2e-2)


def test_gate_sigmoid_mul_add():
    gen = torch.Generator().manual_seed(7)
    h, w, s, f = (torch.randn(*shape, generator=gen) for shape in ((4, 8), (8,), (4, 8), (4, 8)))
    out = f.clone()
    ops.fused_gate_sigmoid_mul_add(h, w, s, out)
    gate = torch.sigmoid(h.double() @ w.double())[:, None]
    torch.testing.assert_close(out.double(), gate * s.double() + f.double(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ops.fused_gate_sigmoid_mul(h, w, s).double(), gate * s.double(), atol=1e-6, rtol=1e-6)


def test_track_states_copies_masked_rows():
    conv = torch.randn(6, 3, 2)
    ssm = torch.randn(6, 2, 2, 2)
    c0, s0 = conv.clone(), ssm.clone()
    ops.track_mamba_states_if_needed(
        conv, ssm, torch.tensor([0, 1, 2]), torch.tensor([True, False, True]), torch.tensor([4, 5, 3]), 3
    )
    assert torch.equal(conv[4], c0[0]) and torch.equal(conv[3], c0[2]) and torch.equal(conv[5], c0[5])
    assert torch.equal(ssm[4], s0[0]) and torch.equal(ssm[3], s0[2])


def test_dummy_weights_seeded_per_parameter():
    class Cfg:
        sglang_l3_dummy_init = weights.CONFIG_VALUE

    def model():
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        m.config = Cfg()
        return m

    m1, m2 = model(), model()
    assert weights.wants_per_parameter_init(m1)
    weights.initialize_per_parameter(m1)
    weights.initialize_per_parameter(m2)
    assert torch.equal(m1[0].weight, m2[0].weight)  # reproducible
    assert not torch.equal(m1[0].weight, m1[1].weight)  # but not one seed for all
    assert not weights.wants_per_parameter_init(torch.nn.Linear(2, 2))
