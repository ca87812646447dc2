"""The models `sglang-l3 plan` knows by name, and loading a local config.json.

The three real models are their published config.json fields (Hugging Face
`Qwen/<name>`; Qwen3.5's under `text_config`): the geometry fields are the ones
benchmark/restore_bench.py's docstring checks against the public configs, the
sizes (hidden, MLP, experts, vocabulary) as THUDM/slime's
`scripts/models/{qwen3.5-27B,qwen3.5-35B-A3B,qwen3-next-80B-A3B}.sh` give them.
The Qwen3.5 vision tower is taken as Qwen3-VL's (27 blocks of width 1152, MLP
4304): it only enters the weight estimate (~0.8 GB in 16 bits, on every rank).
The packaged tiny models are read from `sglang_l3/models/`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang_l3.plan.geometry import ConfigError

_QWEN35_VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
_GDN = {
    "full_attention_interval": 4,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "attn_output_gate": True,
}

PUBLISHED: dict[str, dict[str, Any]] = {
    "Qwen3.5-27B": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {
            **_GDN,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "linear_num_value_heads": 48,
            "vocab_size": 248320,
        },
        "vision_config": {**_QWEN35_VISION, "out_hidden_size": 5120},
    },
    "Qwen3.5-35B-A3B": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": {
            **_GDN,
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "linear_num_value_heads": 32,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "vocab_size": 248320,
        },
        "vision_config": {**_QWEN35_VISION, "out_hidden_size": 2048},
    },
    "Qwen3-Next-80B-A3B": {
        "architectures": ["Qwen3NextForCausalLM"],
        **_GDN,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "linear_num_value_heads": 32,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
    },
}

TINY_DIR = Path(__file__).resolve().parent.parent / "models"
TINY = ("tiny-qwen3next", "tiny-qwen35", "tiny-qwen35-text")


def names() -> list[str]:
    return [*PUBLISHED, *TINY]


def load(model: str) -> tuple[str, dict[str, Any], str]:
    """(name, config, where it came from) for a packaged name, a config.json or a
    model directory holding one."""
    if model in PUBLISHED:
        return model, PUBLISHED[model], "packaged table: published config.json fields"
    path = TINY_DIR / model / "config.json" if model in TINY else Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model {model!r}: neither a packaged model ({', '.join(names())}) nor a config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {model!r}: cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"--model {model!r}: {path} is not a JSON object")
    return (model if model in TINY else path.parent.name), config, str(path)
