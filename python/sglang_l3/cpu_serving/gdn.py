"""Torch-native Gated-DeltaNet: chunked prefill and recurrent decode.

Replaces, on a host without an accelerator, the Triton kernels that
`sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel` calls
(`chunk_gated_delta_rule`, `fused_sigmoid_gating_delta_rule_update`) and the
gating kernel `fused_gdn_gating`. Pure torch, fp32 inside, no sglang import.

The rule, per value head (qk head = value head // (HV // H)), with the state in
sglang's pool layout S: [V, K]:

    g_t    = -exp(A_log) * softplus(a_t + dt_bias)      beta_t = sigmoid(b_t)
    q, k   = l2norm(q), l2norm(k);  q *= K ** -0.5
    S_t    = exp(g_t) * S_{t-1}
    S_t   += beta_t * (v_t - S_t k_t) k_t^T
    o_t    = S_t q_t

Prefill evaluates it chunk by chunk (64 tokens, the WY/UT form FLA uses, in
fp32) and returns the state at the start of every chunk (FLA's `h`), which the
`extra_buffer` Mamba cache copies into track slots; those states are kept in
fp32 so a prefix restored from one of them continues bit-for-bit like the run
that produced it. Each chunk is computed by the same sequence of operations
whatever precedes it, so "prefill 0..N" and "restore h at a chunk boundary,
then prefill the rest" give identical bits. Decode is the plain recurrence.
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64  # FLA's chunk size; hybrid_linear_attn_backend indexes `h` with it


# --------------------------------------------------------------------------- #
# Gating
# --------------------------------------------------------------------------- #
def gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    beta: float = 1.0,
    threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Port of `fused_gdn_gating`: a, b [T, HV] -> g, beta each [1, T, HV] fp32.

    Like the Triton kernel, beta is rounded through b's dtype before it is
    stored in the fp32 output.
    """
    x = a.float() + dt_bias.float()
    softplus = torch.where(beta * x <= threshold, (1.0 / beta) * torch.log1p(torch.exp(beta * x)), x)
    g = -torch.exp(A_log.float()) * softplus
    beta_out = torch.sigmoid(b.float()).to(b.dtype).float()
    return g.unsqueeze(0), beta_out.unsqueeze(0)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, hv: int, scale: float, l2norm: bool):
    """q, k [T, H, K] -> fp32 [T, HV, K] (normalised, q scaled, heads expanded)."""
    q = q.float()
    k = k.float()
    if l2norm:
        q = _l2norm(q)
        k = _l2norm(k)
    q = q * scale
    rep = hv // q.shape[1]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=1)
        k = k.repeat_interleave(rep, dim=1)
    return q, k


# --------------------------------------------------------------------------- #
# Prefill: chunked
# --------------------------------------------------------------------------- #
def _chunked_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_states: list[torch.Tensor] | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k [T, HV, K], v [T, HV, V], g, beta [T, HV] (all fp32,
    q/k prepared); state [HV, V, K] fp32. Returns (o [T, HV, V], final state).
    Appends the state at the start of each chunk to `chunk_states`."""
    T = q.shape[0]
    # head-first; M = S^T [HV, K, V] is the state in the form the chunk algebra uses
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)
    M = state.transpose(-1, -2).contiguous()
    out = torch.empty(v.shape, dtype=torch.float32)
    eye_cache: dict[int, torch.Tensor] = {}
    for c0 in range(0, T, chunk_size):
        if chunk_states is not None:
            chunk_states.append(M.transpose(-1, -2).contiguous())
        c1 = min(c0 + chunk_size, T)
        L = c1 - c0
        qc, kc, vc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1]
        gc, bc = g[:, c0:c1], beta[:, c0:c1]
        G = gc.cumsum(-1)  # [HV, L]
        lower = torch.ones(L, L, dtype=torch.bool).tril()
        # exp(G_i - G_j) for j <= i, 0 above the diagonal (no overflow: masked first)
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        kb = kc * bc[..., None]
        # (I + strictly_lower(beta K K^T * decay))^-1, the WY/UT transform
        strictly_lower = torch.ones(L, L, dtype=torch.bool).tril(-1)
        A = (kb @ kc.transpose(-1, -2) * decay).masked_fill(~strictly_lower, 0.0)
        eye = eye_cache.get(L)
        if eye is None:
            eye = eye_cache[L] = torch.eye(L, dtype=torch.float32)
        Tinv = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
        w = Tinv @ (vc * bc[..., None])  # [HV, L, V]
        u = Tinv @ (kb * G.exp()[..., None])  # [HV, L, K]
        v_new = w - u @ M  # [HV, L, V]
        attn = (qc @ kc.transpose(-1, -2)) * decay  # lower incl. diagonal
        out[:, c0:c1] = (qc * G.exp()[..., None]) @ M + attn @ v_new
        g_last = G[:, -1]
        M = M * g_last.exp()[:, None, None] + (kc * (g_last[:, None] - G).exp()[..., None]).transpose(-1, -2) @ v_new
    return out.transpose(0, 1), M.transpose(-1, -2)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    inplace_update: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """Varlen prefill. q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV];
    initial_state: the state pool [slots, HV, V, K], read at and (inplace_update)
    written to `initial_state_indices`; a negative index is a padding row.

    Returns (o [1, T, HV, V] in q.dtype, None, h [1, sum_i ceil(n_i/64), HV, V, K]
    fp32): FLA's tuple, `h` in FLA's varlen chunk order."""
    HV, V, K = initial_state.shape[1:]
    scale = K**-0.5 if scale is None else scale
    T = q.shape[1]
    o = q.new_empty(1, T, HV, V)
    bounds = cu_seqlens.tolist()
    slots = initial_state_indices.tolist()
    hs: list[torch.Tensor] = []
    for i in range(len(bounds) - 1):
        s, e = int(bounds[i]), int(bounds[i + 1])
        n = e - s
        slot = int(slots[i])
        if slot < 0:
            o[0, s:e] = 0
            # keep FLA's varlen h layout: ceil(n / 64) states per row (0 for n == 0)
            hs.extend(torch.zeros(HV, V, K) for _ in range((n + chunk_size - 1) // chunk_size))
            continue
        if n == 0:
            continue
        qi, ki = _prepare_qk(q[0, s:e], k[0, s:e], HV, scale, use_qk_l2norm_in_kernel)
        oi, final = _chunked_sequence(
            qi,
            ki,
            v[0, s:e].float(),
            g[0, s:e].float(),
            beta[0, s:e].float(),
            initial_state[slot].float(),
            hs,
            chunk_size,
        )
        o[0, s:e] = oi.to(o.dtype)
        if inplace_update:
            initial_state[slot] = final.to(initial_state.dtype)
    h = torch.stack(hs).unsqueeze(0) if hs else None
    return o, None, h


# --------------------------------------------------------------------------- #
# Decode: recurrent
# --------------------------------------------------------------------------- #
def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    disable_state_update: bool = False,
) -> torch.Tensor:
    """Token-by-token rule over a varlen batch (decode: one token per row).
    Shapes as in `chunk_gated_delta_rule`; returns o [1, T, HV, V] in q.dtype."""
    HV, V, K = initial_state.shape[1:]
    scale = K**-0.5 if scale is None else scale
    T = q.shape[1]
    o = q.new_zeros(1, T, HV, V)
    bounds = cu_seqlens.tolist()
    nseq = len(bounds) - 1
    slots = initial_state_indices[:nseq].long()
    qf, kf = _prepare_qk(q[0], k[0], HV, scale, use_qk_l2norm_in_kernel)
    vf, gf, bf = v[0].float(), g[0].float(), beta[0].float()
    if bounds == list(range(nseq + 1)):
        # one token per row: one vectorised step over the batch
        valid = slots >= 0
        rows = valid.nonzero(as_tuple=True)[0]
        if rows.numel() == 0:
            return o
        idx = slots[rows]
        S = initial_state[idx].float()  # [B, HV, V, K]
        out, S = _step(S, qf[rows], kf[rows], vf[rows], gf[rows], bf[rows])
        o[0, rows] = out.to(o.dtype)
        if not disable_state_update:
            initial_state[idx] = S.to(initial_state.dtype)
        return o
    for i in range(nseq):
        s, e = bounds[i], bounds[i + 1]
        slot = int(slots[i])
        if slot < 0 or e <= s:
            continue
        S = initial_state[slot].float()[None]
        for t in range(s, e):
            out, S = _step(S, qf[t : t + 1], kf[t : t + 1], vf[t : t + 1], gf[t : t + 1], bf[t : t + 1])
            o[0, t] = out[0].to(o.dtype)
        if not disable_state_update:
            initial_state[slot] = S[0].to(initial_state.dtype)
    return o


def _step(S, q, k, v, g, beta):
    """S [B, HV, V, K]; q, k [B, HV, K]; v [B, HV, V]; g, beta [B, HV]."""
    S = S * g.exp()[:, :, None, None]
    kv = (S * k[:, :, None, :]).sum(-1)
    u = (v - kv) * beta[..., None]
    S = S + u[..., None] * k[:, :, None, :]
    return (S * q[:, :, None, :]).sum(-1), S


def sigmoid_gating_delta_rule_update(
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    disable_state_update: bool = False,
    **unsupported,
) -> torch.Tensor:
    """Port of `fused_sigmoid_gating_delta_rule_update` (decode): gating + rule."""
    if unsupported.get("intermediate_states_buffer") is not None:
        raise NotImplementedError("sglang-l3 CPU GDN: speculative verify is not ported")
    g, beta = gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    return recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state_source,
        initial_state_indices=initial_state_indices,
        cu_seqlens=cu_seqlens,
        scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        disable_state_update=disable_state_update,
    )


# --------------------------------------------------------------------------- #
# The kernel object GDNKernelDispatcher builds (in place of TritonGDNKernel)
# --------------------------------------------------------------------------- #
def make_kernel_class():
    """A `LinearAttnKernelBase` subclass over the functions above. Built lazily
    so importing this module does not import sglang."""
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import (
        LinearAttnKernelBase,
    )

    class TorchGDNKernel(LinearAttnKernelBase):
        """sglang-l3: torch-native GDN for hosts without an accelerator."""

        supports_packed_decode = False
        supports_strided_target_verify_qkv = False
        uses_state_checkpoints = False
        supports_track_state_snapshot = False  # the backend reads `h` instead

        def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc, **kwargs):
            return sigmoid_gating_delta_rule_update(
                A_log=A_log,
                dt_bias=dt_bias,
                q=q,
                k=k,
                v=v,
                a=a,
                b=b,
                initial_state_source=ssm_states,
                initial_state_indices=cache_indices,
                cu_seqlens=query_start_loc,
            )

        def extend(
            self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, inplace_update=True, **kwargs
        ):
            if kwargs.get("track_state") is not None:
                raise NotImplementedError("sglang-l3 CPU GDN: no in-kernel track snapshot")
            return chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                initial_state=ssm_states,
                initial_state_indices=cache_indices,
                cu_seqlens=query_start_loc,
                inplace_update=inplace_update,
            )

        def target_verify(self, *args, **kwargs):
            raise NotImplementedError("sglang-l3 CPU GDN: speculative verify is not ported")

    return TorchGDNKernel


__all__ = [
    "CHUNK_SIZE",
    "gdn_gating",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "sigmoid_gating_delta_rule_update",
    "make_kernel_class",
]
