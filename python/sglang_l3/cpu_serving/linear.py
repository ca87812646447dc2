"""A linear layer whose result for a token does not depend on which other tokens
share its batch (patch cpu-linear-invariant).

PyTorch's CPU bf16 matmul goes through oneDNN, which picks its kernel, and how it
tiles the rows, from the number of rows M. On a CPU without AVX512-BF16 (oneDNN's
AVX512_CORE / AVX512_CORE_VNNI kernels, e.g. Skylake or Cascade Lake servers) a
row's output changes by an ulp with M: 326 of 704 (shape, M, offset) cases differ
from the same rows computed alone, and even with AMX 14 do (measured with
ONEDNN_MAX_CPU_ISA caps on one Sapphire Rapids box). A cache changes M: a
restored prefix leaves only the tail to prefill (M = 30 where the no-cache server
ran 256-row chunks), and a burst's requests decode side by side. On such a CPU
the TP=2 soak answered 11 of 300 requests a few ulps off the no-cache server
(issue 24), with the same tokens and the same KV restored bit for bit.

Here the rows run in blocks of exactly BLOCK, the last one padded with zero rows,
so every call into oneDNN has the same M and a row's result depends only on
itself and the weight. Padding costs at most BLOCK-1 rows of a tiny model's
matmul; ATen's own bf16 GEMM (mkldnn off) is also invariant but ~60x slower.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

BLOCK = 64  # rows per matmul call: one oneDNN kernel choice for every batch


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), each row computed independently of the others:
    x [..., K], weight [N, K] -> [..., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        return F.linear(x, weight, bias)
    pad = -m % BLOCK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    if m + pad == BLOCK:  # decode and short tails: one call, no concatenation
        out = F.linear(rows, weight, bias)
    else:
        out = torch.cat([F.linear(rows[i : i + BLOCK], weight, bias) for i in range(0, m + pad, BLOCK)])
    return out[:m].reshape(*lead, weight.shape[0])


def _on_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def linear_apply(original, self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
    """AROUND UnquantizedLinearMethod.apply: the plain F.linear path, row-invariant
    on CPU; anything else (packed AMX weights, accelerators) is upstream's."""
    weight = getattr(layer, "weight", None)
    if (
        isinstance(weight, torch.Tensor)
        and _on_cpu(x, weight, bias)
        and not getattr(layer, "use_intel_amx_backend", False)
        and weight.dim() == 2
    ):
        return linear_rows(x, weight, bias)
    return original(self, layer, x, bias)


def linear_apply_into(
    original,
    self,
    layer: torch.nn.Module,
    x: torch.Tensor,
    output: torch.Tensor,
    bias: torch.Tensor | None = None,
):
    """AROUND UnquantizedLinearMethod.apply_into (caller-owned output): the same."""
    weight = getattr(layer, "weight", None)
    if (
        isinstance(weight, torch.Tensor)
        and _on_cpu(x, weight, bias, output)
        and not getattr(layer, "use_intel_amx_backend", False)
        and weight.dim() == 2
        and x.dim() == 2
        and output.shape == (x.shape[0], weight.shape[0])
    ):
        output.copy_(linear_rows(x, weight, bias))
        return output
    return original(self, layer, x, output, bias)


def compute_lm_head(original, self, hidden_states: torch.Tensor, lm_head, embedding_bias=None, *, out=None):
    """AROUND LogitsProcessor._compute_lm_head: upstream's plain branch
    (`torch.matmul(hidden.to(w.dtype), w.T)`: a non-LoRA head whose quant method upstream
    does not apply, without the fp32 or RL options) row-invariant on CPU; every other
    branch is upstream's."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    weight = getattr(lm_head, "weight", None)
    plain = (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and _on_cpu(hidden_states, weight)
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
        and not getattr(self, "use_fp32_lm_head", False)
        and not getattr(lm_head, "use_intel_amx_backend", False)
        and getattr(self, "rl_on_policy_target", None) is None
    )
    if not plain:
        return original(self, hidden_states, lm_head, embedding_bias, out=out)
    assert isinstance(weight, torch.Tensor)  # `plain` checked it
    return linear_rows(hidden_states.to(weight.dtype), weight)


class _RowsFunctional:
    """torch.nn.functional with `linear` row-invariant on CPU (for upstream code that
    calls F.linear directly)."""

    def __getattr__(self, name: str):
        return getattr(F, name)

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if _on_cpu(x, weight, bias) and weight.dim() == 2:
            return linear_rows(x, weight, bias)
        return F.linear(x, weight, bias)


ROWS_F = _RowsFunctional()


def moe_forward_native(original, layer: torch.nn.Module, x: torch.Tensor, *args, **kwargs):
    """AROUND fused_moe_native.moe_forward_native (the CPU MoE path): each expert's
    two F.linear calls take the tokens routed to it, whose count (M) changes with the
    batch; inside the call the module's `F` is ROWS_F, so they are row-invariant.
    Only the scheduler thread of a rank runs a forward, so the swap has no other reader."""
    module: Any = sys.modules[original.__module__]  # upstream's module: its `F` is swapped
    if x.device.type != "cpu" or getattr(module, "F", None) is not F:
        return original(layer, x, *args, **kwargs)
    module.F = ROWS_F
    try:
        return original(layer, x, *args, **kwargs)
    finally:
        module.F = F
