"""Patch `startup-checks` (why: patches/series.toml): refuse an unusable L3 store
or host-memory budget while the launcher parses its arguments, before any model
is loaded.

How: AFTER `ServerArgs.from_cli_args` (the launcher's parse, in
prepare_server_args), in the launching process:

- the store directory is opened with the store's own checks (storage.config +
  storage.safety), as the storage backend would open it when HiCache is built;
- the HiCache host budget is predicted as upstream books it
  (`host_memory_budget_bytes`, `auto_size_hicache`): available - reserve per
  rank, also for an explicit --hicache-size, less the CPU KV pool when
  `--device cpu` runs without `--max-total-tokens`;
- the pinned total of all ranks on this host (`check_pinned_total`): an explicit
  --hicache-size x ranks against the RAM available beyond the reserve and, on ROCm
  with HSA_USERPTR_FOR_PAGED_MEM=0 (host pools are then hipHostMalloc'd GTT memory),
  against the free GTT.

A failure is one line on stderr naming the flag and the fix, exit code 2
(argparse's convention for a bad command line).

With --hicache-ratio (explicit or auto-sized) the pools follow the device pools,
which exist only after the model loaded. So in each rank, AROUND the
`auto_size_hicache` call of `kv_cache_builder` (device pools built, no host pool
yet), the same total is checked with upstream's own device-byte estimate
(`_estimate_hicache_bytes` x the final ratio) against the RAM available when the
ranks got there (MIN over the ranks, taken before any of them pins): every rank
makes the same decision, and a refusal is one logged line naming the setting and
the fix, raised so that upstream's scheduler stops the server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil

from sglang_l3.patches.framework import PatchContext

_SA = "sglang.srt.server_args:ServerArgs"
_AUTO_SIZE = "sglang.srt.mem_cache.kv_cache_builder:auto_size_hicache"
_EXTRA_FLAG = "--hicache-storage-backend-extra-config"
_USERPTR_ENV = "HSA_USERPTR_FOR_PAGED_MEM"
GiB = 1024**3
SYSFS_DRM = Path("/sys/class/drm")  # amdgpu: card*/device/mem_info_gtt_{total,used}
logger = logging.getLogger(__name__)


class StartupCheckError(SystemExit):
    """A command line that cannot serve: message on stderr, exit code 2."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


def _fail(message: str) -> StartupCheckError:
    # one line, so `tail -1` of the launcher's output is the whole story
    return StartupCheckError("sglang-l3: error: " + " ".join(message.split()))


# --------------------------------------------------------------------- store
def parse_extra_config(raw: str | None) -> dict[str, Any]:
    """`--hicache-storage-backend-extra-config`: JSON, or @file (.json/.toml/.yaml),
    read the way upstream reads it (HybridCacheController.parse_storage_backend_extra_config)."""
    if not raw:
        return {}
    try:
        if raw.startswith("@"):
            path = raw[1:]
            ext = os.path.splitext(path)[1].lower()
            if ext == ".toml":
                import tomllib

                with open(path, "rb") as f:
                    data = tomllib.load(f)
            elif ext in (".yaml", ".yml"):
                import yaml

                with open(path) as f:
                    data = yaml.safe_load(f)
            else:
                with open(path) as f:
                    data = json.load(f)
        else:
            data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise _fail(
            f"{_EXTRA_FLAG}: cannot read {raw!r} ({e}). Fix: pass a JSON object, "
            """e.g. '{"store_dir": "/nvme/l3"}', or @config.json."""
        ) from e
    if not isinstance(data, dict):
        raise _fail(
            f"{_EXTRA_FLAG}: expected a JSON object, got {type(data).__name__}. "
            """Fix: e.g. '{"store_dir": "/nvme/l3"}'."""
        )
    return data


def _store_source(extra: Mapping[str, Any], env: Mapping[str, str]) -> str:
    """The setting the store directory came from (StoreSettings.resolve's precedence)."""
    for key in ("store_dir", "file_storage_path"):
        if extra.get(key) not in (None, ""):
            return f"{_EXTRA_FLAG} {key}"
    for name in ("SGLANG_L3_STORE_DIR", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
        if env.get(name):
            return f"store_dir (from ${name})"
    return "store_dir (default location)"


def check_store(extra: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Path:
    """Resolve the store settings and open (create 0700) the store directory with
    the store's own checks; a failure names the setting and the fix."""
    from sglang_l3.storage.config import ConfigError, StoreSettings
    from sglang_l3.storage.safety import UnsafeStoreError, ensure_store_dir

    env = os.environ if env is None else env
    try:
        settings = StoreSettings.resolve(extra, env)
    except ConfigError as e:
        raise _fail(f"{_EXTRA_FLAG}: {e}. Fix the value (see docs/operations.md).") from e
    source = _store_source(extra, env)
    root = Path(settings.root).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise _fail(
            f"{source}={root} is not a directory (it is a file). Fix: point store_dir "
            f"at a directory (created 0700 if missing), or move the file away."
        )
    try:
        return ensure_store_dir(root)
    except UnsafeStoreError as e:
        raise _fail(f"{source}={root}: {e}") from e
    except OSError as e:
        raise _fail(
            f"{source}={root}: cannot create the store directory ({e.strerror or e}). "
            f"Fix: point store_dir at a writable directory you own."
        ) from e


# --------------------------------------------------------------- host memory
def _available_host_bytes() -> int:
    from sglang.srt.mem_cache.host_memory import available_host_memory_bytes

    # with the fallback, a cgroup it cannot read means psutil's figure
    return int(available_host_memory_bytes(allow_cgroup_fallback=True))


def check_host_memory(args: Any, *, available: int | None = None, total: int | None = None) -> None:
    """Predict upstream's host-memory refusals before anything loads.

    Every HiCache host pool is booked against (available - reserve) per rank
    (host_memory_budget_bytes; `HostKVCache._allocate_host_buffer`,
    also for an explicit --hicache-size), so under the reserve nothing can be
    allocated whatever the flags; auto-sizing fails the same way
    (`auto_size_hicache`). With --device cpu and no --max-total-tokens the KV
    pool is carved from that host memory first.
    """
    from sglang.srt.mem_cache.pool_host.base import (
        HICACHE_HOST_MEMORY_RESERVE_BYTES as reserve,
    )

    available = _available_host_bytes() if available is None else available
    total = int(psutil.virtual_memory().total) if total is None else total
    size_gb = float(getattr(args, "hicache_size", 0) or 0)
    device = str(getattr(args, "device", None) or "")
    # auto-sized or not, the host pools come after the CPU KV pool took its share
    if device.split(":")[0] == "cpu" and not getattr(args, "max_total_tokens", None):
        # The KV pool gets what is available beyond capacity * (1 - mem_fraction_static)
        # (upstream's default fraction reserves ~3.6 GiB of activations, 10 GiB above
        # 60 GiB: `handle_gpu_memory_settings`); only that remainder is left.
        fraction = getattr(args, "mem_fraction_static", None)
        if fraction is not None:
            kept = int(total * (1 - float(fraction)))
        else:
            kept = int(max(3.6 * GiB, 10 * GiB if total > 60 * GiB else 0))
        left = min(available, kept)
        if left - reserve <= 0:
            raise _fail(
                f"--max-total-tokens is not set, so with --device cpu the KV pool takes all but "
                f"{left / GiB:.1f} GiB of the {available / GiB:.1f} GiB available host memory, less "
                f"than HiCache's {reserve / GiB:.0f} GiB reserve: no host memory is left for HiCache. "
                f"Fix: pass --max-total-tokens (e.g. 4096)."
            )
    if available - reserve <= 0:
        raise _fail(
            f"--enable-hierarchical-cache: {available / GiB:.1f} GiB host memory available, less "
            f"than HiCache's fixed {reserve / GiB:.0f} GiB reserve (upstream, "
            f"mem_cache/pool_host/base.py), so no HiCache host pool can be allocated, whatever its "
            f"size. Fix: free host memory (more than {reserve / GiB:.0f} GiB available) or run "
            f"without --enable-hierarchical-cache."
        )
    if size_gb > 0:
        # --hicache-size is per rank (KV + Mamba split it): every rank on this host pins it
        check_pinned_total(
            int(size_gb * 1e9),
            _ranks_on_host(args),
            available=available,
            reserve=reserve,
            gtt_free=_gtt_free_if_pinned_there(args),
            setting=f"--hicache-size {size_gb:g}",
            fix=lambda scale: _size_fix(size_gb, scale),
        )


# -------------------------------------------------------- the pinned total
def _ranks_on_host(args: Any) -> int:
    """Ranks on this host, as upstream's `ranks_per_host` counts them (tp x pp / nnodes)."""
    world = int(getattr(args, "tp_size", 1) or 1) * int(getattr(args, "pp_size", 1) or 1)
    return max(1, world // max(1, int(getattr(args, "nnodes", 1) or 1)))


def gtt_free_bytes(root: Path | None = None) -> int | None:
    """Free GTT (mem_info_gtt_total - mem_info_gtt_used) of the least free amdgpu
    card; None where no card reports it."""
    free = []
    for total_file in sorted((root or SYSFS_DRM).glob("card*/device/mem_info_gtt_total")):
        try:
            total = int(total_file.read_text())
            used = int((total_file.parent / "mem_info_gtt_used").read_text())
        except (OSError, ValueError):
            continue
        free.append(max(0, total - used))
    return min(free) if free else None


def pools_in_gtt(storage_backend: str | None, env: Mapping[str, str], hip: bool) -> bool:
    """Whether upstream allocates the HiCache host pools with hipHostMalloc (GTT)
    instead of hipHostRegister: on HIP with HSA_USERPTR_FOR_PAGED_MEM=0 and the
    default host allocator (`_uses_hip_owned_host_memory`)."""
    if not hip or env.get(_USERPTR_ENV) != "0":
        return False
    from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator, get_allocator_from_storage

    return type(get_allocator_from_storage(storage_backend or "default")) is HostTensorAllocator


def _gtt_free_if_pinned_there(args: Any) -> int | None:
    from sglang.srt.utils import is_hip

    if not pools_in_gtt(getattr(args, "hicache_storage_backend", None), os.environ, is_hip()):
        return None
    return gtt_free_bytes()


def _size_fix(size_gb: float, scale: float) -> str:
    fits = math.floor(size_gb * scale * 0.95)  # --hicache-size is whole GB
    return f"--hicache-size {fits} or less" if fits >= 1 else "free host memory or run without HiCache"


def _ratio_fix(ratio: float, scale: float) -> str:
    return f"--hicache-ratio {math.floor(ratio * scale * 0.95 * 100) / 100:g} or less (or --hicache-size)"


def _fraction_fix(fraction: float, scale: float) -> str:
    return f"--hicache-host-memory-fraction {math.floor(fraction * scale * 0.95 * 100) / 100:g} or less"


def check_pinned_total(
    per_rank: int,
    ranks: int,
    *,
    available: int,
    reserve: int,
    gtt_free: int | None,
    setting: str,
    fix: Callable[[float], str],
) -> None:
    """The HiCache host pools of every rank on this host (per_rank bytes each:
    host KV + Mamba) must fit the host RAM available beyond upstream's reserve, and,
    when upstream allocates them as GTT (`pools_in_gtt`), the free GTT all ranks
    share. `fix(scale)` names the setting scaled by `scale` (< 1), which fits."""
    total = per_rank * ranks
    what = (
        f"the HiCache host pools of the {ranks} rank(s) on this host take {_size(total)} "
        f"({ranks} x {_size(per_rank)}, host KV + Mamba)"
    )
    room = available - reserve
    if room <= 0:
        raise _fail(
            f"{setting}: {what}, but only {_size(available)} of host memory is available, less than "
            f"HiCache's fixed {reserve / GiB:.0f} GiB reserve (`host_memory_budget_bytes`), so no host "
            f"pool can be allocated, whatever its size. Fix: free host memory (more than "
            f"{reserve / GiB:.0f} GiB available) or run without --enable-hierarchical-cache."
        )
    if total > room:
        raise _fail(
            f"{setting}: {what}, but only {_size(room)} of host memory is available beyond HiCache's "
            f"{reserve / GiB:.0f} GiB reserve ({_size(available)} available; upstream books every pool "
            f"against it, `host_memory_budget_bytes`). Fix: {fix(room / total)}."
        )
    if gtt_free is not None and total > gtt_free:
        raise _fail(
            f"{setting}: {what}; with {_USERPTR_ENV}=0 they are GTT memory (hipHostMalloc), which the ranks "
            f"share, and only {_size(gtt_free)} of GTT is free (mem_info_gtt_total - "
            f"mem_info_gtt_used). Fix: unset {_USERPTR_ENV} (pools pinned with hipHostRegister, from "
            f"host RAM), or {fix(gtt_free / total)}."
        )


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _hybrid_host_bytes(params: Any, ratio: float) -> int | None:
    """FULL KV + Mamba (the Qwen hybrids): the host pools as upstream sizes them
    from the device pools (`HostKVCache.__init__`: int(capacity x ratio) tokens
    rounded down to pages plus one padding page; `MambaPoolHost.__init__`:
    int(slots x ratio) + 1 slots), bytes per token and per slot as the device pools
    hold them. None for any other pool layout (or packed draft layers)."""
    kv = params.token_to_kv_pool_allocator.get_kvcache()
    full = getattr(kv, "full_kv_pool", None)
    mamba = getattr(params.req_to_token_pool, "mamba_pool", None)
    states = getattr(mamba, "mamba_cache", None)
    if full is None or states is None or params.mtp_draft_device_pools or not hasattr(full, "v_head_dim"):
        return None
    assert mamba is not None  # it holds `states`
    page = params.page_size
    tokens = full.size if full.host_capacity_tokens is None else full.host_capacity_tokens
    per_token = (full.head_dim + full.v_head_dim) * full.head_num * full.layer_num * full.store_dtype.itemsize
    slots = mamba.size if mamba.host_capacity_tokens is None else mamba.host_capacity_tokens
    per_slot = sum(t[:, 0].numel() * t.element_size() for t in (*states.conv, states.temporal))
    return (int(tokens * ratio) // page + 1) * page * per_token + (int(slots * ratio) + 1) * per_slot


def rank_host_bytes(params: Any, draft_plan: Any, *, hicache_ratio: float, hicache_size: float) -> int | None:
    """Bytes one rank's HiCache host pools take (host KV + Mamba): --hicache-size GB
    when set; else from the device pools and the ratio, exactly for the hybrids
    (`_hybrid_host_bytes`), otherwise upstream's own estimate
    (`_estimate_hicache_bytes` x the ratio, an upper bound: it counts every device
    Mamba buffer). None for pools that estimate does not cover."""
    if hicache_size > 0:
        return int(hicache_size * 1e9)
    if draft_plan is None:
        exact = _hybrid_host_bytes(params, hicache_ratio)
        if exact is not None:
            return exact
    from sglang.srt.mem_cache.hicache_auto_size import _estimate_hicache_bytes

    try:
        return int(_estimate_hicache_bytes(params, draft_plan) * hicache_ratio)
    except ValueError:  # a pool kind auto-sizing cannot size either: nothing to predict
        return None


def _agreed_available() -> int:
    """RAM available now, MIN over every rank (one all-reduce, the same on all of
    them): taken before any rank pins, so each one decides on the same figure."""
    import torch

    available = _available_host_bytes()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from sglang.srt.runtime_context import get_parallel

        value = torch.tensor([available], dtype=torch.int64)
        torch.distributed.all_reduce(
            value, op=torch.distributed.ReduceOp.MIN, group=get_parallel().world_group.cpu_group
        )
        available = int(value.item())
    return available


def check_rank_pools(params: Any, draft_plan: Any, available: int) -> None:
    """In a rank, once the ratio is final: the pinned total of all ranks fits."""
    from sglang.srt.mem_cache.pool_host.base import HICACHE_HOST_MEMORY_RESERVE_BYTES, ranks_per_host
    from sglang.srt.runtime_context import get_memory
    from sglang.srt.utils import is_hip

    memory = get_memory()
    size, ratio = float(memory.hicache_size or 0), float(memory.hicache_ratio or 0)
    per_rank = rank_host_bytes(params, draft_plan, hicache_ratio=ratio, hicache_size=size)
    if per_rank is None:
        return
    fraction = memory.hicache_host_memory_fraction
    if size > 0:
        setting, fix = f"--hicache-size {size:g}", lambda scale: _size_fix(size, scale)
    elif fraction is None:
        setting, fix = f"--hicache-ratio {ratio:g}", lambda scale: _ratio_fix(ratio, scale)
    else:
        setting = f"--hicache-host-memory-fraction {fraction:g} (auto-sized --hicache-ratio {ratio:.3g})"
        fix = lambda scale: _fraction_fix(fraction, scale)  # noqa: E731
    gtt = gtt_free_bytes() if pools_in_gtt(memory.hicache_storage_backend, os.environ, is_hip()) else None
    check_pinned_total(
        per_rank,
        ranks_per_host(),
        available=available,
        reserve=HICACHE_HOST_MEMORY_RESERVE_BYTES,
        gtt_free=gtt,
        setting=setting,
        fix=fix,
    )


@contextlib.contextmanager
def _around_auto_size(original: Callable[..., Any], params: Any, draft_plan: Any, *, enabled: bool) -> Iterator[None]:
    available = _agreed_available() if enabled else 0
    with original(params, draft_plan, enabled=enabled):
        if enabled:
            try:
                check_rank_pools(params, draft_plan, available)
            except StartupCheckError as e:
                logger.error(e.message)
                # an Exception (not SystemExit): upstream's scheduler reports it and stops the server
                raise RuntimeError(e.message) from None
        yield


# ------------------------------------------------------------------- the hook
def check_args(args: Any) -> None:
    if not getattr(args, "enable_hierarchical_cache", False):
        return
    if getattr(args, "hicache_storage_backend", None) == "file":
        check_store(parse_extra_config(getattr(args, "hicache_storage_backend_extra_config", None)))
    check_host_memory(args)


def _after_from_cli_args(result: Any, cls: Any, args: Any) -> None:
    try:
        check_args(result)
    except StartupCheckError as e:
        print(e.message, file=sys.stderr, flush=True)
        raise


def apply(ctx: PatchContext) -> None:
    ctx.after(f"{_SA}.from_cli_args", _after_from_cli_args)
    ctx.around(_AUTO_SIZE, _around_auto_size)
