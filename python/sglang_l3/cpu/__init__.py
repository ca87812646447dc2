"""CPU support for the real cache stack (tests, `make demo`, CPU serving).

Never active in a process that has an accelerator: `enable()` refuses. It
applies the `cpu-host-pools` patch (series.toml), which makes HiCache host pools
work without a GPU driver: no host pinning/registration, and pure-torch ports
of the `direct` transfer ops. Use io backend `direct` with layout
`page_first_direct` (what upstream's own Mamba HiCache tests use).
"""

from __future__ import annotations

import os


class AcceleratorPresent(RuntimeError):
    pass


def accelerator_present() -> bool:
    import torch

    try:
        return torch.accelerator.current_accelerator(check_available=True) is not None
    except Exception:  # older torch
        return torch.cuda.is_available()


def enable() -> None:
    """Apply the CPU shims in this process (idempotent)."""
    if accelerator_present():
        raise AcceleratorPresent(
            "sglang_l3.cpu.enable(): an accelerator is present; the CPU shims are "
            "for machines without one and are never activated next to a GPU"
        )
    os.environ["SGLANG_L3_CPU"] = "1"
    from sglang_l3.patches import framework

    for spec in framework.load_series():
        if spec.id == "cpu-host-pools":
            st = framework.apply_one(spec)
            if st.state != framework.State.APPLIED:
                raise RuntimeError(f"cpu-host-pools not applied: {st.state.value} {st.detail}")
            return
    raise RuntimeError("series.toml has no 'cpu-host-pools' entry")


def enabled() -> bool:
    from sglang_l3.patches import framework

    return framework.is_applied("cpu-host-pools")
