"""Per-parameter seeded dummy weights for the packaged tiny model.

Upstream `initialize_dummy_weights` (model_loader/weight_utils.py) seeds every
parameter with the same seed and draws from +-1e-3: on a tiny model every layer
is near zero and greedy decoding repeats one token, so "same output after a
restore" would prove nothing. Here each parameter gets its own seed (the CRC of
its name) and a fan-in scale, so the output depends on the whole context and
runs are reproducible across processes and machines (the CPU generator is used
whatever the device).
"""

from __future__ import annotations

import zlib

import torch

# A config that carries this key (with this value) opts into the init below.
CONFIG_KEY = "sglang_l3_dummy_init"
CONFIG_VALUE = "per-parameter-v1"


def wants_per_parameter_init(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, CONFIG_KEY, None) == CONFIG_VALUE


@torch.no_grad()
def initialize_per_parameter(model: torch.nn.Module, seed: int = 1234) -> None:
    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed + zlib.crc32(name.encode()))
        t = torch.empty(param.shape, dtype=torch.float32)
        if param.dim() >= 2:
            fan_in = max(param[0].numel(), 1)
            t.normal_(0.0, fan_in**-0.5, generator=gen)
        else:
            t.uniform_(-0.1, 0.1, generator=gen)
        param.data.copy_(t.to(device=param.device, dtype=param.dtype))
