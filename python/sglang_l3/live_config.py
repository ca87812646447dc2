"""What a server runs with now, read in the tokenizer process.

Upstream 0.5.23 changes some settings at runtime without touching the launch
`server_args`: `PUT /hicache/storage-backend` and `DELETE` record the storage backend
(and its extra config) through `TokenizerManager.attach_hicache_storage` /
`detach_hicache_storage` -> `record_config_updates` into the runtime context's config
bags, which `TokenizerManager.config_value(name)` reads. Anything that decides by
"is L3 attached" reads it here, never from the launch arguments alone.
"""

from __future__ import annotations

from typing import Any


def value(tokenizer_manager: Any, name: str) -> Any:
    """The value in effect for config field `name` (launch argument until changed)."""
    live = getattr(tokenizer_manager, "config_value", None)
    if live is not None:
        try:
            return live(name)
        except ValueError:  # no config published in this process (a manager built in a test)
            pass
    return getattr(getattr(tokenizer_manager, "server_args", None), name, None)


def l3_attached(tokenizer_manager: Any) -> bool:
    """HiCache with a storage backend (L3) attached now: pages outlive the process.
    HiCache itself cannot be switched on at runtime (upstream's scheduler refuses the
    attach without it), so that part is the launch argument."""
    args = getattr(tokenizer_manager, "server_args", None)
    return bool(getattr(args, "enable_hierarchical_cache", False)) and bool(
        value(tokenizer_manager, "hicache_storage_backend")
    )
