"""sglang-l3's NVMe store for HiCache L3 (the `file` backend, patch `store-file`).

Modules (the first group imports neither torch nor sglang, so the CLI is instant):
  config     settings from extra-config JSON / env
  safety     store directory checks (0700, owner, not group/world-writable), key validation
  identity   model / shard / pool identity (reusable: identity_for(storage_config))
  format     page header v1 and file names (docs/format.md)
  io_engine  parallel vectored IO, O_DIRECT, atomic writes, durability
  store      PageStore: exists/read/write, quarantine, budget (LRUFileEvictor)
  index      scan a store directory: stats, coverage, verify, evict, clear
  (counters: sglang_l3.metrics, the one counter path; counters() = its store part)
  pagemap    host pool page <-> zero-copy memoryview runs      (torch)
  backend    L3FileStore(HiCacheStorage)                        (torch + sglang)
  cli, doctor
"""

from __future__ import annotations

from typing import Any

from sglang_l3.metrics import store_counters as counters
from sglang_l3.storage.config import StoreSettings, default_store_dir
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard, identity_for

__all__ = [
    "StoreSettings",
    "default_store_dir",
    "ModelIdentity",
    "PoolLayout",
    "Shard",
    "identity_for",
    "counters",
    "L3FileStore",
]


def __getattr__(name: str) -> Any:  # lazy: importing the backend pulls in sglang
    if name == "L3FileStore":
        from sglang_l3.storage.backend import L3FileStore

        return L3FileStore
    raise AttributeError(name)
