"""Builders shared by the test_store_* modules: real upstream host pools on CPU.

(No tests here; the name only matches the files this area owns.)
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch


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
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = [torch.zeros(tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros(tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers)]
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=tuple(k),
            v=tuple(v),
            k_data_ptrs=torch.tensor([x.data_ptr() for x in k], dtype=torch.uint64),
            v_data_ptrs=torch.tensor([x.data_ptr() for x in v], dtype=torch.uint64),
            layout=KVBufferLayout.NHD,
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=layers,
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
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    temporal = torch.zeros(layers, slots, *temporal_shape, dtype=ssm_dtype)
    conv = tuple(torch.zeros(layers, slots, *s, dtype=conv_dtype) for s in conv_shapes)
    info = MambaStateBufferInfo(temporal=temporal, conv=conv)
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout)


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


def storage_config(
    *, tp_rank: int = 0, tp_size: int = 1, model: str = "test/model", extra: Optional[dict] = None, is_mla: bool = False
):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config=dict(extra or {}),
    )


def make_store(root, *, kv=None, mamba=None, **kw):
    """L3FileStore on `root` with pools registered the way the hybrid controller does."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang_l3.storage.backend import L3FileStore

    extra = {"store_dir": str(root), "min_free_bytes": 0, **kw.pop("extra", {})}
    store = L3FileStore(storage_config(extra=extra, **kw))
    if kv is not None:
        store.register_mem_pool_host(kv)
        store.register_mem_host_pool_v2(kv, PoolName.KV)
    if mamba is not None:
        store.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    return store


def keys(n: int, tag: str = "k") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def page_files(root) -> list[str]:
    return sorted(os.listdir(os.path.join(str(root), "pages")))


def quarantine_files(root) -> list[str]:
    return sorted(os.listdir(os.path.join(str(root), "quarantine")))
