"""Patch `cpu-sim-streams` (why: patches/series.toml): a simulated asynchronous
device for CPU test runs, so a missing fence, wait or event shows.

How: `sglang_l3.sim.streams.install(seed)` points torch.cpu's Stream/Event/
stream/current_stream/synchronize (what upstream's `get_device_module()` returns
without an accelerator) at a seeded queued-stream simulator (REGISTRY, undone by
the context), and AROUND the host pools' transfer methods (KV and Mamba, load
and backup) queues each call on the caller's current stream when that is not the
default stream, and AROUND `HiCacheController.move_indices`
charges a device->host read of device indices (io backend `direct`; not a host copy taken
by `sglang_l3.device_reads.host_copy`) as the sync it is on a GPU
(`sim_streams.device_read`). Applies only when asked: the CPU switch and
SGLANG_L3_SIM_STREAMS=<seed>[:threaded] (tests and benchmark/stall_bench.py, through
`sglang_l3.sim.harness.simulated_device`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_l3 import envs
from sglang_l3.patches.framework import PatchContext

ENV = "SGLANG_L3_SIM_STREAMS"
_MHA = "sglang.srt.mem_cache.pool_host.mha:MHATokenToKVPoolHost"
_MAMBA = "sglang.srt.mem_cache.pool_host.mamba:MambaPoolHost"
TRANSFERS = (
    (f"{_MHA}.load_to_device_per_layer", "kv-load"),
    (f"{_MHA}.backup_from_device_all_layer", "kv-backup"),
    (f"{_MAMBA}.load_to_device_per_layer", "mamba-load"),
    (f"{_MAMBA}.backup_from_device_all_layer", "mamba-backup"),
)


def setting() -> tuple[int, bool]:
    """(seed, threaded) from SGLANG_L3_SIM_STREAMS=<seed>[:threaded]."""
    raw = envs.value(ENV).strip()
    seed, _, mode = raw.partition(":")
    try:
        if mode not in ("", "threaded"):
            raise ValueError
        return int(seed), mode == "threaded"
    except ValueError:
        raise ValueError(f"{ENV} must be an integer seed, optionally :threaded (e.g. {ENV}=1), got {raw!r}") from None


def applicable() -> str | None:
    from sglang_l3.cpu import not_applicable_reason

    reason = not_applicable_reason()
    if reason:
        return reason
    if not envs.value(ENV).strip():
        return f"{ENV} not set (the simulated device is opt-in, for tests)"
    setting()  # a malformed value is an error, not a silent no-op
    return None


def _queued(what: str) -> Callable[..., Any]:
    from sglang_l3.sim.streams import deferred

    def hook(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return deferred(orig, what)(*args, **kwargs)

    return hook


MOVE_INDICES = "sglang.srt.managers.cache_controller:HiCacheController.move_indices"


def _move_indices(orig: Callable[..., Any], cc: Any, host_indices: Any, device_indices: Any) -> Any:
    from sglang_l3.device_reads import is_host_copy
    from sglang_l3.sim.streams import device_read

    if cc.io_backend == "direct" and not is_host_copy(device_indices):
        device_read()  # upstream's device_indices.cpu()
    return orig(cc, host_indices, device_indices)


def apply(ctx: PatchContext) -> None:
    from sglang_l3.sim import streams as sim_streams

    seed, threaded = setting()
    sim_streams.install(seed, threaded=threaded)
    ctx.on_undo(sim_streams.uninstall)
    for path, what in TRANSFERS:
        ctx.around(path, _queued(what))
    ctx.around(MOVE_INDICES, _move_indices)
