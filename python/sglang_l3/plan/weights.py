"""Weight bytes per rank and prefill work, estimated from config.json.

Parameters are counted from the Qwen3-Next / Qwen3.5 layer structure (gated
full attention, Gated-DeltaNet projections, dense or MoE MLP, the vision tower of
a multimodal config). Quantization applies to the decoder's linear layers only;
embeddings, lm_head, the MoE router, norms, conv weights and the vision tower stay
in 16 bits, as GPTQ checkpoints of these models ship them. An estimate: a
checkpoint's own choices (a quantized lm_head, act-order `g_idx`) move it by a few
percent, and `--weights-gib` replaces it with the real figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_l3.plan.geometry import Geometry, text_config

# bits per weight of a quantized linear layer: GPTQ stores per group of 128 weights
# one fp16 scale and one packed zero point of the weight's bit width
QUANT_BITS = {
    "bf16": 16.0,
    "fp16": 16.0,
    "fp8": 8.0,
    "gptq-8bit": 8 + (16 + 8) / 128,
    "gptq-4bit": 4 + (16 + 4) / 128,
}


@dataclass(frozen=True)
class Params:
    """Parameter counts by how they are stored and split across TP ranks."""

    linear: int  # decoder linear weights: quantized, split across ranks
    linear_active: int  # of those, what one token multiplies through (MoE: top-k + shared)
    vocab: int  # embedding + untied lm_head: 16-bit, vocab-parallel
    replicated: int  # 16-bit on every rank: MoE router, vision tower
    split_other: int  # 16-bit, split: conv1d weights, norms, GDN A/dt

    @property
    def total(self) -> int:
        return self.linear + self.vocab + self.replicated + self.split_other


def _mlp(t: dict[str, Any], layer: int, hidden: int) -> tuple[int, int, int]:
    """(linear, active linear, router) parameters of one decoder layer's MLP."""
    experts = int(t.get("num_experts") or 0)
    dense_only = layer in set(t.get("mlp_only_layers") or ())
    step = int(t.get("decoder_sparse_step") or 1)
    if experts and not dense_only and (layer + 1) % step == 0:
        per_expert = 3 * hidden * int(t["moe_intermediate_size"])
        shared = 3 * hidden * int(t.get("shared_expert_intermediate_size") or 0)
        top_k = int(t.get("num_experts_per_tok") or 1)
        router = hidden * experts + (hidden if shared else 0)  # expert gate + shared-expert gate
        return experts * per_expert + shared, top_k * per_expert + shared, router
    dense = 3 * hidden * int(t["intermediate_size"])
    return dense, dense, 0


def _vision(config: dict[str, Any]) -> int:
    v = config.get("vision_config")
    if not v:
        return 0
    h, inter, depth = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["depth"])
    block = 4 * h * h + 2 * h * inter  # qkv + proj, fc1 + fc2
    patch = int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 2)) * int(v["patch_size"]) ** 2 * h
    merge = int(v.get("spatial_merge_size", 2)) ** 2 * h
    merger = merge * merge + merge * int(v.get("out_hidden_size", h))
    return depth * block + patch + merger


def count(config: dict[str, Any]) -> Params:
    t = text_config(config)
    g = Geometry.from_config(config)
    hidden = int(t["hidden_size"])
    vocab = int(t["vocab_size"]) * hidden
    tied = bool(t.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    q = g.num_attention_heads * g.head_dim
    gate = 2 if t.get("attn_output_gate", True) else 1
    attn = hidden * q * gate + 2 * hidden * g.num_key_value_heads * g.head_dim + q * hidden
    k, v = g.linear_num_key_heads * g.linear_key_head_dim, g.linear_num_value_heads * g.linear_value_head_dim
    gdn = hidden * (2 * k + 2 * v) + hidden * 2 * g.linear_num_value_heads + v * hidden  # qkvz, ba, out
    linear = active = router = 0
    full = set(i for i, x in enumerate(g.layer_types) if x == "full_attention") or {
        i for i in range(g.num_hidden_layers) if (i + 1) % g.full_attention_interval == 0
    }
    for layer in range(g.num_hidden_layers):
        mixer = attn if layer in full else gdn
        m, m_active, r = _mlp(t, layer, hidden)
        linear += mixer + m
        active += mixer + m_active
        router += r
    conv = g.gdn_layers * g.conv_dim(1) * g.linear_conv_kernel_dim
    other = conv + g.num_hidden_layers * 2 * hidden + g.gdn_layers * 2 * g.linear_num_value_heads
    return Params(
        linear=linear,
        linear_active=active,
        vocab=vocab * (1 if tied else 2),
        replicated=router + _vision(config),
        split_other=other,
    )


def bytes_per_rank(params: Params, quant: str, tp: int) -> int:
    if quant not in QUANT_BITS:
        raise ValueError(f"--quant {quant!r}: one of {', '.join(QUANT_BITS)}")
    linear = params.linear * QUANT_BITS[quant] / 8 / tp
    return int(linear + (params.vocab + params.split_other) * 2 / tp + params.replicated * 2)


def prefill_flops(params: Params, g: Geometry, tokens: int) -> float:
    """Forward FLOPs of a prefill of `tokens` from an empty cache: 2 per active
    weight per token, plus causal attention (QK^T and AV) in the full layers. The
    GDN recurrence (linear in tokens, small beside its projections) is left out."""
    attn = 2 * g.full_layers * g.num_attention_heads * g.head_dim * float(tokens) ** 2
    return 2.0 * params.linear_active * tokens + attn
