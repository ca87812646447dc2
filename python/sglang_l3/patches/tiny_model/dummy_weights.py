"""Patch `tiny-model-dummy-weights` (why: patches/series.toml): per-parameter
seeded dummy weights for the packaged tiny model (python/sglang_l3/models/tiny-qwen3next).

How: AROUND the loader's `initialize_dummy_weights`: a model whose config carries
`"sglang_l3_dummy_init": "per-parameter-v1"` (our packaged config) gets a seed per
parameter (CRC of its name) and a fan-in scale; any other model gets upstream's
init. So it applies with or without an accelerator: the GPU e2e variant serves the
same model with the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_l3.patches.framework import PatchContext


def apply(ctx: PatchContext) -> None:
    from sglang_l3.cpu_serving import weights

    def initialize_dummy_weights(original: Callable, model: Any, *args: Any, **kwargs: Any) -> Any:
        if not weights.wants_per_parameter_init(model):
            return original(model, *args, **kwargs)
        ctx.fired("per_parameter")
        return weights.initialize_per_parameter(model)

    ctx.around("sglang.srt.model_loader.loader:initialize_dummy_weights", initialize_dummy_weights)
