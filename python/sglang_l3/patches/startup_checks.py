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
  `--device cpu` runs without `--max-total-tokens`.

A failure is one line on stderr naming the flag and the fix, exit code 2
(argparse's convention for a bad command line).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from sglang_l3.patches.framework import PatchContext

_SA = "sglang.srt.server_args:ServerArgs"
_EXTRA_FLAG = "--hicache-storage-backend-extra-config"
GiB = 1024**3


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
    # the budget is split between the ranks on this host (ranks_per_host)
    ranks = max(
        1,
        int(getattr(args, "tp_size", 1) or 1)
        * int(getattr(args, "pp_size", 1) or 1)
        // max(1, int(getattr(args, "nnodes", 1) or 1)),
    )
    per_rank = (available - reserve) / ranks
    if size_gb > 0 and size_gb * 1e9 > per_rank:
        raise _fail(
            f"--hicache-size {size_gb:g}: {size_gb:g} GB per rank requested, but only "
            f"{per_rank / 1e9:.1f} GB per rank ({ranks} on this host) of host memory is free beyond "
            f"HiCache's {reserve / GiB:.0f} GiB reserve. Fix: --hicache-size "
            f"{max(0.1, per_rank / 1e9 * 0.8):.1f} or less."
        )


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
