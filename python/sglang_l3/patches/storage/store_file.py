"""Patch `store-file` (why: patches/series.toml): `--hicache-storage-backend file`
-> sglang-l3's NVMe store.

How: two edits.
1. "file" is registered to sglang_l3.storage.backend.L3FileStore through
   upstream's `StorageBackendFactory.register_backend` (undo restores upstream's
   own entry; SGLANG_L3_DISABLE=store-file keeps it).
2. AFTER HiCacheController.attach_storage_backend: when the backend is ours,
   select the controller's zero-copy page functions (batch_get_v1 /
   batch_set_v1 straight on host-pool memory). Upstream picks them by backend
   name in that method and "file" is not in its list, so KV pages would
   otherwise go through a temporary flat tensor and an extra copy.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from sglang_l3.patches.framework import PatchContext

REGISTRY = "sglang.srt.mem_cache.storage.backend_factory:StorageBackendFactory._registry"
ATTACH = "sglang.srt.managers.cache_controller:HiCacheController.attach_storage_backend"
MODULE, CLASS = "sglang_l3.storage.backend", "L3FileStore"


@contextlib.contextmanager
def _quiet(log: logging.Logger, text: str) -> Iterator[None]:
    def drop(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def apply(ctx: PatchContext) -> None:
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    for name in ("_page_get_zero_copy", "_page_set_zero_copy"):
        if not callable(getattr(HiCacheController, name, None)):
            raise RuntimeError(f"HiCacheController.{name} not found - upstream changed")
    registry = StorageBackendFactory._registry
    previous = registry.get("file")
    if previous is None:
        raise RuntimeError("upstream registers no 'file' storage backend - upstream changed")
    # upstream's public extension point; it warns on every re-registration, and
    # replacing "file" is this patch's intent, so that one warning is dropped
    with _quiet(logging.getLogger(StorageBackendFactory.__module__), "is already registered, overwriting"):
        StorageBackendFactory.register_backend("file", MODULE, CLASS)
    # upstream has no unregister: undo puts its own entry back
    ctx.on_undo(lambda: registry.__setitem__("file", previous))

    def select_zero_copy(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
        from sglang_l3.storage.backend import L3FileStore

        backend = getattr(self, "storage_backend", None)
        inner = getattr(backend, "_backend", backend)  # test-only failure injector wraps it
        if isinstance(inner, L3FileStore):
            self.page_get_func = self._page_get_zero_copy
            self.page_set_func = self._page_set_zero_copy
            ctx.fired("zero_copy_selected")
        return None

    ctx.after(ATTACH, select_zero_copy)
