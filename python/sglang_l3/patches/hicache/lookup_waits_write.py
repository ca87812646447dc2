"""Patch `lookup-waits-write` (why: patches/series.toml): an L3 lookup of pages whose
write is queued waits for that write instead of missing.

How: AROUND `HybridCacheController.write_storage` the pages an operation will write
((pool, key): its KV keys, each independent sidecar's keys, a KV-derived sidecar's KV
keys) are noted with the store before the operation is queued; AROUND
`HiCacheController._page_backup_or_log` (the backup thread's whole write of one
operation, success or not) they are released after it; AROUND `HiCacheController.reset`
(which drops the queued operations) all are. The store's lookups wait, bounded, for the
noted pages they ask about (`sglang_l3.storage.pending_writes`). Only a backend with
`expect_writes` (the `file` store) is told; any other is left alone.

TP: each rank waits for its own write, then upstream MIN-reduces the hit counts as
before; no rank answers differently from a rank whose write had already finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sglang_l3.patches.framework import PatchContext
from sglang_l3.storage.backend import pool_key
from sglang_l3.storage.pending_writes import Page

HYBRID = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller:HybridCacheController"
BASE = "sglang.srt.managers.cache_controller:HiCacheController"


def operation_pages(hash_value: Sequence[str] | None, transfers: Sequence[Any] | None) -> list[Page]:
    """The pages one storage operation writes, the same before and after the backup
    thread resolves its derived sidecars (a sidecar derived from another sidecar is
    left out: its keys are only known then)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv = list(hash_value or [])
    pages: list[Page] = [(pool_key(PoolName.KV), k) for k in kv]
    for t in transfers or ():
        src = getattr(t, "indices_from_pool", None)
        if src is None:
            keys = list(t.keys or [])
        elif src == PoolName.KV:
            keys = kv
        else:
            continue
        pages += [(pool_key(t.name), k) for k in keys]
    return pages


def _noting_backend(ctrl: Any) -> Any:
    backend = getattr(ctrl, "storage_backend", None)
    return backend if hasattr(backend, "expect_writes") else None


def apply(ctx: PatchContext) -> None:
    def write_storage(
        orig: Any,
        self: Any,
        host_indices: Any,
        token_ids: Any,
        hash_value: Any = None,
        prefix_keys: Any = None,
        extra_pools: Any = None,
    ) -> Any:
        backend = _noting_backend(self)
        pages = operation_pages(hash_value, extra_pools) if backend is not None else []
        if pages:
            backend.expect_writes(pages)  # before the queue: the backup thread may finish it at once
        try:
            return orig(self, host_indices, token_ids, hash_value, prefix_keys, extra_pools=extra_pools)
        except BaseException:
            if pages:
                backend.writes_finished(pages)
            raise

    def page_backup_or_log(orig: Any, self: Any, operation: Any) -> Any:
        try:
            return orig(self, operation)
        finally:
            backend = _noting_backend(self)
            if backend is not None:
                pages = operation_pages(operation.hash_value, getattr(operation, "pool_transfers", None))
                if pages:
                    backend.writes_finished(pages)

    def reset(orig: Any, self: Any) -> Any:
        out = orig(self)
        backend = _noting_backend(self)
        if backend is not None:
            backend.pending_writes.clear()  # the queued operations were dropped
        return out

    ctx.around(f"{HYBRID}.write_storage", write_storage)
    ctx.around(f"{BASE}._page_backup_or_log", page_backup_or_log)
    ctx.around(f"{BASE}.reset", reset)
