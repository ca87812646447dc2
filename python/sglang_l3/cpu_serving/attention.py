"""Causal extend attention whose result for a token does not depend on where the
prefill chunk around it starts or ends (patch cpu-attention-invariant).

Upstream's torch_native backend runs one SDPA per request over the whole sequence
so far (the cached prefix plus the chunk, the prefix rows as unused queries).
PyTorch's CPU flash kernel splits the keys into blocks counted from that total
length, so the last block's width, and with it the rounding of a row's softmax
sum and of its P.V product, changes with the chunk's end: the same token gets
bf16 outputs one ulp apart when a prompt is prefilled in 256-token chunks, in 512
or after a cached prefix (measured: rows 179 and 216 of the chunk [1024, 1280)
of a tiny Qwen3.5 prompt with an image, propagated to 1.6e-2 in logprobs).

Here the queries run in blocks fixed in absolute positions ([k*B, (k+1)*B)), each
block against exactly the keys [0, (k+1)*B) with an explicit causal mask: every
SDPA call for a block has the same shapes and, for the rows it answers, the same
inputs whoever issues it. Rows of a block outside the chunk are zero queries and
keys past the sequence are zero and masked (their weight is exactly 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 64  # query rows per SDPA call, aligned to absolute positions


def _causal_mask(lo: int, hi: int, device: torch.device) -> torch.Tensor:
    rows = torch.arange(lo, hi, device=device).unsqueeze(1)
    return torch.arange(hi, device=device).unsqueeze(0) <= rows


def causal_extend_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_len: int,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """query [n, H, D]: the rows prefix_len .. prefix_len+n-1; key [prefix_len+n, Hk, D]
    and value [prefix_len+n, Hk, Dv], in the query's dtype. Returns [n, H, Dv]."""
    n, heads, dim = query.shape
    seq = prefix_len + n
    out = query.new_empty(n, heads, value.shape[-1])
    if n == 0:
        return out
    first, last = prefix_len // BLOCK, (seq - 1) // BLOCK
    padded = (last + 1) * BLOCK
    # [Hk, padded, D], zero past the sequence; each block reads a prefix view of it
    k_all = key.new_zeros(key.shape[1], padded, key.shape[2])
    v_all = value.new_zeros(value.shape[1], padded, value.shape[2])
    k_all[:, :seq] = key.movedim(0, 1)
    v_all[:, :seq] = value.movedim(0, 1)
    q_rows = query.movedim(0, 1)  # [H, n, D]
    for blk in range(first, last + 1):
        lo, hi = blk * BLOCK, (blk + 1) * BLOCK
        r0, r1 = max(lo, prefix_len), min(hi, seq)
        q_blk = query.new_zeros(heads, BLOCK, dim)
        q_blk[:, r0 - lo : r1 - lo] = q_rows[:, r0 - prefix_len : r1 - prefix_len]
        o = F.scaled_dot_product_attention(
            q_blk.unsqueeze(0),
            k_all[:, :hi].unsqueeze(0),
            v_all[:, :hi].unsqueeze(0),
            attn_mask=_causal_mask(lo, hi, query.device),
            scale=scale,
            enable_gqa=enable_gqa,
        )[0]
        out[r0 - prefix_len : r1 - prefix_len] = o[:, r0 - lo : r1 - lo].movedim(0, 1)
    return out


def sdpa_forward_extend(
    original,
    self,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor | None = None,
    scaling=None,
    enable_gqa: bool = False,
    causal: bool = False,
    is_cross_attn: bool = False,
    sliding_window_size: int | None = None,
):
    """AROUND TorchNativeAttnBackend._run_sdpa_forward_extend: plain causal
    self-attention goes through causal_extend_attention; encoder, cross-attention,
    sliding-window and non-causal calls keep upstream's path."""
    windowed = sliding_window_size is not None and sliding_window_size > -1
    if not causal or is_cross_attn or encoder_lens is not None or windowed:
        return original(
            self,
            query,
            output,
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices,
            seq_lens,
            extend_prefix_lens,
            extend_seq_lens,
            encoder_lens,
            scaling=scaling,
            enable_gqa=enable_gqa,
            causal=causal,
            is_cross_attn=is_cross_attn,
            sliding_window_size=sliding_window_size,
        )
    start = 0
    for i in range(seq_lens.shape[0]):
        n, prefix, seq = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
        tokens = req_to_token[req_pool_indices[i], :seq]
        q = query[start : start + n]
        k, v = k_cache[tokens].to(q.dtype), v_cache[tokens].to(q.dtype)
        output[start : start + n] = causal_extend_attention(q, k, v, prefix, scaling, enable_gqa)
        start += n
    return output
