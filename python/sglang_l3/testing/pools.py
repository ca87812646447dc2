"""Real upstream host pools and storage configs on CPU, for store tests and benchmarks.

The store is driven the way HiCacheController drives it: pages live in upstream's
own `MHATokenToKVPoolHost` / `MambaPoolHost` (page_first by default), registered
through upstream's v1/v2 pool registration. Device buffers only describe
geometry here, so they are as small as the pool classes allow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def host_budget() -> Iterator[None]:
    """Book host pools against half of the RAM free now, through upstream's own
    `host_memory_budget_scope`: without it upstream keeps a fixed 10 GiB reserve,
    which a busy test machine does not always have (the pools here are a few MB)."""
    import psutil
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(psutil.virtual_memory().available // 2):
        yield


def host_kv_pool(
    *,
    layers: int,
    heads: int,
    head_dim: int,
    page_size: int,
    device_tokens: int,
    layout: str = "page_first",
    dtype: torch.dtype = torch.bfloat16,
    host_ratio: float = 2.0,
    host_token_capacity: int | None = None,
) -> Any:
    """A real `MHATokenToKVPoolHost` over CPU 'device' buffers (no pinning)."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = [torch.zeros(device_tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros(device_tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers)]
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
    extra = {} if host_token_capacity is None else {"host_token_capacity": host_token_capacity}
    with host_budget():
        return MHATokenToKVPoolHost(
            info,
            host_ratio,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device_tokens,
            start_layer=0,
            end_layer=layers,
            **extra,
        )


def host_mamba_pool(
    temporal: torch.Tensor,
    conv: tuple[torch.Tensor, ...],
    *,
    host_ratio: float = 2.0,
    layout: str = "page_first",
) -> Any:
    """A real `MambaPoolHost` shaped like the device state buffers `temporal` / `conv`
    ([layers, slots, ...]; expanded zero tensors are enough to describe geometry)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=temporal, conv=conv)
    with host_budget():
        return MambaPoolHost(
            info,
            host_ratio,
            0,
            device_capacity=temporal.shape[1],
            pin_memory=False,
            device="cpu",
            layout=layout,
        )


def storage_config(
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = "test/model",
    extra: dict | None = None,
    is_mla: bool = False,
) -> Any:
    """Upstream's `HiCacheStorageConfig` as the controller builds it for a page_first layout."""
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


def register_pools(store: Any, kv: Any = None, mamba: Any = None) -> None:
    """Register host pools with a store the way the hybrid controller does."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    if kv is not None:
        store.register_mem_pool_host(kv)
        store.register_mem_host_pool_v2(kv, PoolName.KV)
    if mamba is not None:
        store.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
