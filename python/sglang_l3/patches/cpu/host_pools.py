"""Patch `cpu-host-pools` (why: patches/series.toml): HiCache host pools on a
machine without a GPU driver.

How (REGISTRY edits, each undone by the context): ALLOC_MEMORY_FUNCS["cpu"]
allocates unpinned; HostKVCache.pin_memory reads False (a data descriptor on the
base class wins over the attribute the pools set); the torch ports of the
`direct` transfer ops (sglang_l3.cpu.transfer_ops) are bound in the host-pool
modules. Only applies when requested (SGLANG_L3_CPU_SERVING=1, or
sglang_l3.cpu.enable()) and no accelerator is present.
"""

from __future__ import annotations

import importlib
from typing import Any

from sglang_l3.patches.framework import PatchContext

_MISSING = object()


def applicable() -> str | None:
    from sglang_l3.cpu import not_applicable_reason

    return not_applicable_reason()


def apply(ctx: PatchContext) -> None:
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    from sglang_l3.cpu.transfer_ops import HOST_POOL_MODULES, OPS

    orig_alloc = common.alloc_with_host_register

    def alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        ctx.fired("alloc_unpinned")
        return orig_alloc(
            dims,
            dtype=dtype,
            device=device,
            pin_memory=False,
            allocator=allocator,
            registration_granularity_bytes=registration_granularity_bytes,
        )

    funcs = common.ALLOC_MEMORY_FUNCS
    prev_cpu = funcs.get("cpu", _MISSING)
    funcs["cpu"] = alloc_unpinned

    def restore_alloc() -> None:
        if prev_cpu is _MISSING:
            funcs.pop("cpu", None)
        else:
            funcs["cpu"] = prev_cpu

    ctx.on_undo(restore_alloc)

    # A data descriptor on the base class wins over the instance attribute the
    # pools set in __init__, so every pool (and every torch.empty it passes
    # pin_memory to) sees False.
    prev_pin = HostKVCache.__dict__.get("pin_memory", _MISSING)
    HostKVCache.pin_memory = property(lambda self: False, lambda self, value: None)

    def restore_pin() -> None:
        if prev_pin is _MISSING:
            del HostKVCache.pin_memory
        else:
            HostKVCache.pin_memory = prev_pin

    ctx.on_undo(restore_pin)

    for modname in HOST_POOL_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        previous: dict[str, Any] = {n: getattr(mod, n, _MISSING) for n in OPS}
        for name, fn in OPS.items():
            setattr(mod, name, fn)

        def restore_ops(mod: Any = mod, previous: dict[str, Any] = previous) -> None:
            for n, v in previous.items():
                if v is _MISSING:
                    if hasattr(mod, n):
                        delattr(mod, n)
                else:
                    setattr(mod, n, v)

        ctx.on_undo(restore_ops)
