"""Torch-native ports of the small Triton kernels on the Qwen3-Next GDN path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    activation: str = "swish",
    eps: float = 1e-6,
) -> torch.Tensor:
    """`FusedRMSNormGated` (fla/fused_norm_gate.py, no residual):
    rmsnorm(x) * weight (+ bias), times act(gate); fp32 inside, x.dtype out."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    gf = gate.float()
    if activation == "sigmoid":
        y = y * torch.sigmoid(gf)
    elif activation in ("swish", "silu"):
        y = y * F.silu(gf)
    else:
        raise NotImplementedError(f"sglang-l3 CPU gated RMSNorm: activation {activation!r}")
    return y.to(x.dtype)


def fused_qkvzba_split_reshape_cat(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Port of `triton_gdn_fused_proj.fused_qkvzba_split_reshape_cat`; the same
    split as upstream's own fallback `Qwen3GatedDeltaNet.fix_query_key_value_ordering`.

    mixed_qkvz [T, nqk * (2*hqk + 2*r*hv)] (per qk-head groups [q | k | v | z]),
    mixed_ba [T, nqk * 2r] ([b | a] per group), r = nv // nqk.
    Returns mixed_qkv [T, nqk*hqk*2 + nv*hv] = [q... | k... | v...], z [T, nv, hv],
    b [T, nv], a [T, nv]."""
    T = mixed_qkvz.shape[0]
    r = num_heads_v // num_heads_qk
    grouped = mixed_qkvz.view(T, num_heads_qk, 2 * head_qk + 2 * r * head_v)
    q, k, v, z = torch.split(grouped, [head_qk, head_qk, r * head_v, r * head_v], dim=-1)
    mixed_qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    ba = mixed_ba.view(T, num_heads_qk, 2 * r)
    b, a = torch.split(ba, [r, r], dim=-1)
    return (
        mixed_qkv,
        z.reshape(T, num_heads_v, head_v).contiguous(),
        b.reshape(T, num_heads_v).contiguous(),
        a.reshape(T, num_heads_v).contiguous(),
    )


def _track_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots):
    mask = mamba_track_mask[:batch_size].bool()
    src = cache_indices[:batch_size][mask].long()
    dst = mamba_track_indices[:batch_size][mask].long()
    if check_freed_slots:
        ok = (src >= 0) & (dst >= 0)
        src, dst = src[ok], dst[ok]
    return src, dst


def track_mamba_states_if_needed(
    conv_states,
    ssm_states,
    cache_indices,
    mamba_track_mask,
    mamba_track_indices,
    batch_size,
    check_freed_slots=False,
):
    """Port of `mamba_state_scatter_triton.track_mamba_states_if_needed`: copy
    the conv and SSM state of each masked row's slot into its track slot (one layer)."""
    src, dst = _track_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots)
    if src.numel():
        conv_states[dst] = conv_states[src]
        ssm_states[dst] = ssm_states[src]


def track_mamba_states_all_layers(
    conv_states_pool,
    ssm_states_pool,
    cache_indices,
    mamba_track_mask,
    mamba_track_indices,
    batch_size,
    check_freed_slots=False,
):
    """Port of `track_mamba_states_all_layers`: pools are [layers, slots, ...]."""
    src, dst = _track_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots)
    if src.numel():
        conv_states_pool[:, dst] = conv_states_pool[:, src]
        ssm_states_pool[:, dst] = ssm_states_pool[:, src]


def _gate_sigmoid(hidden_states: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    # element-wise product + row sum (not a matmul): a row's gate does not depend
    # on how many rows are in the batch
    return torch.sigmoid((hidden_states.float() * gate_weight.float()[None, :]).sum(-1))[:, None]


def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
    """Port of `elementwise.fused_gate_sigmoid_mul`: sigmoid(h . w) * shared_output."""
    gate = _gate_sigmoid(hidden_states, gate_weight)
    return (gate * shared_output.float()).to(shared_output.dtype)


def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
    """Port of `elementwise.fused_gate_sigmoid_mul_add`: in place,
    final += sigmoid(h . w) * shared_output (fp32 inside)."""
    gate = _gate_sigmoid(hidden_states, gate_weight)
    result = gate * shared_output.float() + final_hidden_states.float()
    final_hidden_states.copy_(result.to(final_hidden_states.dtype))


# --------------------------------------------------------------------------- #
# Qwen3.5 (sglang.srt.models.qwen3_5)
# --------------------------------------------------------------------------- #
def fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Port of `triton_gdn_fused_proj.fused_qkvzba_split_reshape_cat_contiguous`
    (Qwen3.5: separate in_proj_qkv / in_proj_z checkpoints, merged on load).

    mixed_qkvz rows are [all q | all k | all v | all z] (nqk*hqk, nqk*hqk, nv*hv,
    nv*hv; the row stride may be wider, as the kernel reads `stride(0)`), mixed_ba
    rows [all b | all a]. Unlike Qwen3-Next's per-group interleave
    (`fused_qkvzba_split_reshape_cat` above) nothing is regrouped: the outputs are
    slices. Returns new tensors like the kernel: mixed_qkv [T, 2*nqk*hqk + nv*hv],
    z [T, nv, hv], b [T, nv], a [T, nv]."""
    T = mixed_qkvz.shape[0]
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    v_dim = num_heads_v * head_v
    mixed_qkv = mixed_qkvz[:, :qkv_dim].contiguous()
    z = mixed_qkvz[:, qkv_dim : qkv_dim + v_dim].reshape(T, num_heads_v, head_v).contiguous()
    b = mixed_ba[:, :num_heads_v].contiguous()
    a = mixed_ba[:, num_heads_v : 2 * num_heads_v].contiguous()
    return mixed_qkv, z, b, a


def _gate_activation(y: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation in ("swish", "silu"):
        return y * (z * torch.sigmoid(z))  # the kernel's z * sigmoid(z)
    if activation == "sigmoid":
        return y * torch.sigmoid(z)
    raise NotImplementedError(f"sglang-l3 CPU gated RMSNorm: activation {activation!r}")


def layernorm_gated_rms(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    activation: str = "swish",
) -> torch.Tensor:
    """Port of `fla.layernorm_gated.rms_norm_gated(is_rms_norm=True)`, the forward
    of `fla.layernorm_gated.RMSNorm`: per row (per group of `group_size` columns)
    y = x * rsqrt(mean(x^2) + eps) * weight (+ bias), gated by act(z) after the
    norm (norm_before_gate) or before it. fp32 inside, x.dtype out, x's shape.
    z: x's shape, or [T, H, N] for a 2-D x of T*H rows (the kernel's Z_IS_3D)."""
    shape = x.shape
    n = shape[-1]
    xf = x.reshape(-1, n).float()
    zf = None
    if z is not None:
        if z.shape != shape and not (len(shape) == 2 and z.ndim == 3 and z.shape[0] * z.shape[1] == xf.shape[0]):
            raise ValueError(f"gated RMSNorm: gate shape {tuple(z.shape)} does not fit x {tuple(shape)}")
        zf = z.reshape(-1, n).float()
    if zf is not None and not norm_before_gate:
        xf = _gate_activation(xf, zf, activation)
    g = n if group_size is None else group_size
    if n % g:
        raise ValueError(f"gated RMSNorm: group size {g} does not divide {n}")
    xg = xf.view(xf.shape[0], n // g, g)
    y = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).view_as(xf)
    y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    if zf is not None and norm_before_gate:
        y = _gate_activation(y, zf, activation)
    return y.to(x.dtype).reshape(shape)


def fused_sigmoid_mul(
    attn_output: torch.Tensor, gate: torch.Tensor, inplace: bool = False, quant: bool = False
) -> torch.Tensor:
    """Port of `elementwise.fused_sigmoid_mul`: attn_output * sigmoid(gate), fp32
    inside, attn_output's dtype out; in place when asked. The gate is either
    attn_output's shape or, for a 2-D attn_output [T, H*D], a 3-D (strided) view
    [T, H, D] (Qwen3.5's q/gate split leaves it strided)."""
    if quant:
        raise NotImplementedError("sglang-l3 CPU fused_sigmoid_mul: FP8 output (quant=True)")
    if gate.ndim == 3 and attn_output.ndim == 2:
        t, h, d = gate.shape
        if attn_output.shape != (t, h * d):
            raise ValueError(f"fused_sigmoid_mul: gate {tuple(gate.shape)} vs output {tuple(attn_output.shape)}")
        gate = gate.reshape(t, h * d)
    elif attn_output.shape != gate.shape:
        raise ValueError("fused_sigmoid_mul: attn_output and gate must have the same shape")
    result = (attn_output.float() * torch.sigmoid(gate.float())).to(attn_output.dtype)
    if inplace:
        return attn_output.copy_(result)
    return result
