"""A hybrid model's cache geometry from its config.json, per tensor-parallel rank.

The same formulas as SGLang 0.5.23 sizes its pools with
(`Qwen3NextConfig.mamba2_cache_params`, inherited by `Qwen3_5TextConfig`, and
`Mamba2StateShape.create`): full-attention layers are every
`full_attention_interval`-th layer, the rest Gated-DeltaNet (GDN); a GDN state is
the temporal state (value heads/tp, value dim, key dim) in `mamba_ssm_dtype`
(float32 unless the config says otherwise) plus the conv window
(conv_dim/tp, kernel - 1) in the model dtype; KV heads are split across ranks (one
kept per rank when there are fewer heads than ranks). The MTP layer holds state
only with speculative decoding, so it is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8_e4m3fn": 1}


class ConfigError(ValueError):
    """A config.json that lacks a field the planner needs (names it)."""


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text backbone's fields: `text_config` of a multimodal config, else the config."""
    return dict(config.get("text_config", config))


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"config.json has no {key!r} (a hybrid Qwen3-Next / Qwen3.5 config is expected)")
    return int(value)


@dataclass(frozen=True)
class Geometry:
    """The config.json fields the per-rank cache sizes derive from."""

    num_hidden_layers: int
    full_attention_interval: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    ssm_dtype_bytes: int = 4
    max_position_embeddings: int = 0
    layer_types: tuple[str, ...] = ()  # config.json's, when it lists them

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Geometry:
        t = text_config(config)
        ssm = str(t.get("mamba_ssm_dtype") or "float32")
        if ssm not in DTYPE_BYTES:
            raise ConfigError(f"config.json mamba_ssm_dtype {ssm!r} is not one of {sorted(DTYPE_BYTES)}")
        hidden = _int(t, "hidden_size")
        heads = _int(t, "num_attention_heads")
        return cls(
            num_hidden_layers=_int(t, "num_hidden_layers"),
            full_attention_interval=_int(t, "full_attention_interval"),
            num_attention_heads=heads,
            num_key_value_heads=_int(t, "num_key_value_heads"),
            head_dim=_int(t, "head_dim", hidden // heads),
            linear_num_key_heads=_int(t, "linear_num_key_heads"),
            linear_num_value_heads=_int(t, "linear_num_value_heads"),
            linear_key_head_dim=_int(t, "linear_key_head_dim"),
            linear_value_head_dim=_int(t, "linear_value_head_dim"),
            linear_conv_kernel_dim=_int(t, "linear_conv_kernel_dim"),
            ssm_dtype_bytes=DTYPE_BYTES[ssm],
            max_position_embeddings=int(t.get("max_position_embeddings") or 0),
            layer_types=tuple(str(x) for x in t.get("layer_types") or ()),
        )

    @property
    def full_layers(self) -> int:
        """Layers ids i with (i + 1) % interval == 0 (SGLang's `layers_block_type`), or
        the config's own `layer_types` where it lists them."""
        if self.layer_types:
            return sum(1 for x in self.layer_types if x == "full_attention")
        return self.num_hidden_layers // self.full_attention_interval

    @property
    def gdn_layers(self) -> int:
        return self.num_hidden_layers - self.full_layers

    def check_tp(self, tp: int) -> None:
        """Head counts must split evenly, as SGLang's linear layers require."""
        for name in ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads"):
            if getattr(self, name) % tp:
                raise ConfigError(f"--tp {tp} does not divide the model's {name} ({getattr(self, name)})")
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:
            raise ConfigError(f"--tp {tp} and the model's num_key_value_heads ({kv}) do not divide each other")

    def kv_heads_per_rank(self, tp: int) -> int:
        return max(1, self.num_key_value_heads // tp)

    def kv_bytes_per_token(self, tp: int, kv_dtype_bytes: int = 2) -> int:
        """K and V of every full-attention layer, one rank."""
        return self.full_layers * 2 * self.kv_heads_per_rank(tp) * self.head_dim * kv_dtype_bytes

    def conv_dim(self, tp: int) -> int:
        k = self.linear_num_key_heads * self.linear_key_head_dim
        v = self.linear_num_value_heads * self.linear_value_head_dim
        return (2 * k + v) // tp

    def temporal_bytes(self, tp: int) -> int:
        """One GDN layer's temporal (SSM) state, one rank."""
        heads = self.linear_num_value_heads // tp
        return heads * self.linear_value_head_dim * self.linear_key_head_dim * self.ssm_dtype_bytes

    def conv_bytes(self, tp: int, conv_dtype_bytes: int = 2) -> int:
        """One GDN layer's conv window, one rank."""
        return self.conv_dim(tp) * (self.linear_conv_kernel_dim - 1) * conv_dtype_bytes

    def state_bytes(self, tp: int, conv_dtype_bytes: int = 2) -> int:
        """One Mamba/GDN checkpoint (every GDN layer's temporal + conv state), one rank:
        one device or host pool slot, one L3 state page."""
        return self.gdn_layers * (self.temporal_bytes(tp) + self.conv_bytes(tp, conv_dtype_bytes))
