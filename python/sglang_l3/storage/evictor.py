"""Byte cap + free-space floor with LRU eviction: upstream's LRUFileEvictor.

It fits as is: it tracks `<stem>.bin` files in one flat directory that end in
this rank's suffix, seeds LRU from mtime at start-up, and exposes
reserve/commit/abort/touch. We hand it the pages/ directory, explicit limits
(so our settings win over its env defaults) and a per-rank share of the cap.
Imported lazily: it pulls in sglang.srt (slow to import, and the CLI and the
crash-test writer do not need it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def fs_usage(path: str) -> tuple[int, int]:
    """(total, available-to-us) bytes of the filesystem holding path."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def make_evictor(
    pages_dir: str,
    *,
    owned_suffixes: tuple[str, ...],
    tp_rank: int,
    max_bytes: int,
    min_free_bytes: int,
    eviction_ratio: float,
    on_evict: Callable[[str], None] | None = None,
    retention: Any | None = None,
    counters: Any | None = None,
) -> Any | None:
    if max_bytes <= 0 and min_free_bytes <= 0:
        return None
    from sglang.srt.mem_cache.storage.file.lru_file_evictor import LRUFileEvictor

    cls: Any = LRUFileEvictor
    if retention is not None:  # session classes decide the victims (retention.py)
        from sglang_l3.storage.retention import make_session_evictor

        cls = make_session_evictor(LRUFileEvictor, retention, counters)
    ev = cls(
        pages_dir,
        owned_suffixes=owned_suffixes,
        tp_rank=tp_rank,
        extra_config={
            "max_size": int(max_bytes),
            "min_free_space": int(min_free_bytes),
            "eviction_ratio": float(eviction_ratio),
        },
        on_evict=on_evict,
    )
    return ev if ev.enabled else None
