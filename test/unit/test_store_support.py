"""Builders shared by the test_store_* modules: real upstream host pools on CPU.

(No tests here; the name only matches the files this area owns.)
"""

from __future__ import annotations

import os
from typing import Any

import torch
from sglang_l3.testing.pools import host_kv_pool, host_mamba_pool, register_pools, storage_config

__all__ = ["storage_config"]  # re-exported: test_store_patch imports it from here


def make_kv_pool(
    layout: str = "page_first",
    *,
    dtype=torch.bfloat16,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 8,
    page_size: int = 4,
    tokens: int = 64,
):
    """A real MHATokenToKVPoolHost over CPU 'device' buffers (no pinning)."""
    return host_kv_pool(
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        page_size=page_size,
        device_tokens=tokens,
        layout=layout,
        dtype=dtype,
    )


def make_mamba_pool(
    *,
    layers: int = 3,
    slots: int = 8,
    ssm_dtype=torch.float32,
    conv_dtype=torch.bfloat16,
    temporal_shape=(2, 4, 4),
    conv_shapes=((6, 3),),
    layout: str = "page_first",
):
    temporal = torch.zeros(layers, slots, *temporal_shape, dtype=ssm_dtype)
    conv = tuple(torch.zeros(layers, slots, *s, dtype=conv_dtype) for s in conv_shapes)
    return host_mamba_pool(temporal, conv, layout=layout)


def fill_random(pool: Any, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in _buffers(pool):
        u8 = buf.view(-1).view(torch.uint8) if buf.is_contiguous() else None
        if u8 is not None and u8.numel():
            u8.copy_(torch.randint(0, 256, (u8.numel(),), generator=g, dtype=torch.uint8))


def zero(pool: Any) -> None:
    for buf in _buffers(pool):
        buf.zero_()


def _buffers(pool: Any) -> list:
    if hasattr(pool, "temporal_buffer"):
        return [pool.temporal_buffer, *pool.conv_buffer, *pool.slot_state_buffers]
    return [pool.kv_buffer]


def page_bytes(pool: Any, index: int) -> bytes:
    """Upstream's flat page (what HiCacheFile writes) as bytes."""
    return pool.get_data_page(index, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def make_store(root, *, kv=None, mamba=None, **kw):
    """L3FileStore on `root` with pools registered the way the hybrid controller does."""
    from sglang_l3.storage.backend import L3FileStore

    extra = {"store_dir": str(root), "min_free_bytes": 0, **kw.pop("extra", {})}
    store = L3FileStore(storage_config(extra=extra, **kw))
    register_pools(store, kv, mamba)
    return store


def keys(n: int, tag: str = "k") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def page_files(root) -> list[str]:
    return sorted(os.listdir(os.path.join(str(root), "pages")))


def quarantine_files(root) -> list[str]:
    return sorted(os.listdir(os.path.join(str(root), "quarantine")))
