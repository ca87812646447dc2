"""CPU support for the real cache stack and for serving the tiny model without
an accelerator (tests, `make demo`, the CPU server launcher).

Activates only when asked: the environment switch `SGLANG_L3_CPU_SERVING=1`
(what `sglang_l3.testing.server.Server` sets for its children) or `enable()`
in this process before the patch queue is applied (`sglang_l3.plugin.register()`).
Never merely because no accelerator is present, and never next to one:
`enable()` refuses, and the patches that read the switch (`cpu-host-pools`,
group `cpu-serving`) report "not applicable" there.
"""

from __future__ import annotations

import os

from sglang_l3 import envs

ENV_SWITCH = "SGLANG_L3_CPU_SERVING"


class AcceleratorPresent(RuntimeError):
    pass


def accelerator_present() -> bool:
    import torch

    try:
        return torch.accelerator.current_accelerator(check_available=True) is not None
    except Exception:  # older torch
        return torch.cuda.is_available()


def requested() -> bool:
    """The switch is on in this process (children inherit it)."""
    return envs.value(ENV_SWITCH) == "1"


def not_applicable_reason() -> str | None:
    """None when the CPU patches should apply here, else why not."""
    if not requested():
        return f"CPU serving not requested ({ENV_SWITCH}=1 or sglang_l3.cpu.enable())"
    if accelerator_present():
        return "an accelerator is present"
    return None


def enable() -> None:
    """Turn the switch on for this process and its children (idempotent).

    Call before the patch queue is applied (`sglang_l3.plugin.register()`);
    the queue reads the switch when it decides what applies."""
    if accelerator_present():
        raise AcceleratorPresent(
            "sglang_l3.cpu.enable(): an accelerator is present; the CPU shims are "
            "for machines without one and are never activated next to a GPU"
        )
    os.environ[ENV_SWITCH] = "1"


def enabled() -> bool:
    return not_applicable_reason() is None
