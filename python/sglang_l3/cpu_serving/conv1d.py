"""Torch-native causal depthwise conv1d with a rolling state (prefill and decode).

Ports of `sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn` /
`causal_conv1d_update` for the shapes the GDN backend uses. The state of a
slot is the last `L = conv_states.shape[-1]` (>= W - 1) inputs, [dim, L].

Every output is `bias + sum_w weight[:, w] * window[:, w]` accumulated in fp32
in the order w = 0..W-1 by element-wise ops, so an output depends only on its
window: prefill in one piece, in chunks, or as decode steps gives the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1


_LANES = 64  # pad rows to a multiple of any SIMD width torch uses on CPU


def _activate(y: torch.Tensor, activation) -> torch.Tensor:
    """y [..., dim, n] -> activation(y), computed on a token-major copy whose
    rows are padded to a multiple of 64 elements. torch's CPU element-wise
    kernels run full SIMD vectors and finish a tail with a scalar loop whose
    exp() can differ in the last bit; with this layout every element takes the
    vector path, so the result does not depend on n (prefill vs decode)."""
    if activation in (None, False, "identity"):
        return y
    if activation not in ("silu", "swish", True):
        raise NotImplementedError(f"sglang-l3 CPU conv1d: activation {activation!r}")
    dim = y.shape[-2]
    rows = y.transpose(-1, -2)  # [..., n, dim]
    pad = (-dim) % _LANES
    padded = F.pad(rows, (0, pad)).contiguous()
    return F.silu(padded)[..., :dim].transpose(-1, -2)


def _conv(full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int):
    """full [dim, W-1+n] fp32 -> [dim, n] fp32 (before the activation)."""
    W = weight.shape[1]
    y = full[:, 0:n] * weight[:, 0:1]
    for w in range(1, W):
        y = y + full[:, w : w + n] * weight[:, w : w + 1]
    if bias is not None:
        y = y + bias[:, None]
    return y


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens_cpu=None,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs,
) -> torch.Tensor:
    """Varlen prefill. x [dim, T] (sequences concatenated, bounded by
    query_start_loc); weight [dim, W]; conv_states [slots, dim, L] read (when
    has_initial_state) and updated in place at cache_indices. Returns [dim, T]."""
    dim = x.shape[0]
    W = weight.shape[1]
    L = conv_states.shape[-1]
    out = torch.zeros_like(x)
    bounds = query_start_loc.tolist()
    nseq = len(bounds) - 1
    slots = cache_indices.tolist() if cache_indices is not None else list(range(nseq))
    init = has_initial_state.tolist() if has_initial_state is not None else [False] * nseq
    wf = weight.float()
    bf = bias.float() if bias is not None else None
    for i in range(nseq):
        s, e = int(bounds[i]), int(bounds[i + 1])
        slot = int(slots[i])
        if slot < 0 or slot == pad_slot_id or e <= s:
            continue
        n = e - s
        prev = conv_states[slot].float() if init[i] else torch.zeros(dim, L, dtype=torch.float32)
        full = torch.cat([prev, x[:, s:e].float()], dim=1)  # [dim, L + n]
        y = _conv(full[:, L - (W - 1) :], wf, bf, n)
        out[:, s:e] = _activate(y, activation).to(out.dtype)
        conv_states[slot] = full[:, -L:].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation=None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs,
) -> torch.Tensor:
    """Decode. x [B, dim] or [B, dim, n]; conv_state [slots, dim, L] updated in
    place at conv_state_indices (row b itself when None). Same shape out as x."""
    for unsupported in ("num_accept_tokens", "intermediate_conv_window", "retrieve_parent_token"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"sglang-l3 CPU conv1d: {unsupported} (speculative decoding) is not ported")
    if cache_seqlens is not None:
        raise NotImplementedError("sglang-l3 CPU conv1d: circular conv state is not ported")
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    B, dim, n = x.shape
    W = weight.shape[1]
    L = conv_state.shape[-1]
    out = torch.zeros_like(x)
    slots = conv_state_indices.long() if conv_state_indices is not None else torch.arange(B)
    rows = ((slots >= 0) & (slots != pad_slot_id)).nonzero(as_tuple=True)[0]
    if rows.numel():
        idx = slots[rows]
        wf = weight.float()
        bf = bias.float() if bias is not None else None
        full = torch.cat([conv_state[idx].float(), x[rows].float()], dim=2)  # [b, dim, L+n]
        tail = full[:, :, L - (W - 1) :]
        y = tail[:, :, 0:n] * wf[None, :, 0:1]
        for w in range(1, W):
            y = y + tail[:, :, w : w + n] * wf[None, :, w : w + 1]
        if bf is not None:
            y = y + bf[None, :, None]
        out[rows] = _activate(y, activation).to(out.dtype)
        conv_state[idx] = full[:, :, -L:].to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out
