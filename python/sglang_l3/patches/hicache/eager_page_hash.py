"""Patch `eager-page-hash` (why: patches/series.toml): load HiCache's page-hash
extension when the storage backend is attached, not inside the first prefetch.

How: AFTER HiCacheController.attach_storage_backend (the point where
get_hash_str is bound) the extension is loaded (upstream's lazy, cached
`_load_native_hash_module`) on the attaching thread: at start-up, before the
server reports ready. A load failure is logged and left to upstream's own path
(it raises at first use, as before).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.patches.eager_page_hash")

_ATTACH = "sglang.srt.managers.cache_controller:HiCacheController.attach_storage_backend"


def _load(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    if not getattr(self, "enable_storage", False):
        return  # attach failed or rolled back: upstream's error stands
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    try:
        _load_native_hash_module()
    except RuntimeError as e:
        logger.warning(
            "sglang-l3: page-hash extension not loaded at attach (%s); upstream loads it at first use",
            e,
        )


def apply(ctx: PatchContext) -> None:
    ctx.after(_ATTACH, _load)
