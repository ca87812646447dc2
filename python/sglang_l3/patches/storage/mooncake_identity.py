"""Patch `mooncake-identity`: Mooncake object keys carry sglang-l3's page identity.

Upstream defect (0.5.23, mem_cache/storage/mooncake_store/mooncake_store.py):
objects are named `{config_prefix}_{page hash}_{tp_rank}_k` (KV) and
`..._{tp_rank}_temporal` / `_conv_{i}` (Mamba), where `config_prefix` is only
the optional `extra_backend_tag` plus the served model name (`__init__`, the
"Use the backend tag and model name as a prefix" block). Dtypes, page size,
layout, weights and TP size are not in the key, and a read only checks that
the bytes arrived (`_batch_postprocess`: "res > 0"). Two servers sharing a
master with the same model name but bf16 vs fp16 KV (same page bytes) read
each other's pages as valid: silently wrong KV. The file store avoids this
with self-describing pages (sglang_l3.storage.identity); Mooncake objects are
opaque, so the identity has to go into the key.

How: AFTER `MooncakeStore.register_mem_pool_host` and
`register_mem_host_pool_v2` (both run at attach time, before any page I/O)
set `config_prefix` to upstream's prefix + `l3-<model digest>-<shard>-<pool
layouts digest>`: ModelIdentity (model, config, weights, quantization, dtypes,
page size, layout, parallel sizes) from `identity_for`, the rank's Shard name,
and each registered host pool's PoolLayout (dtype and shape of every page
component). `_tag_keys` (not hooked) then prefixes every object key. A
foreign server's pages are simply other keys: misses, never wrong data.
Identical on every TP rank up to the shard name, which is rank-local by design
(each rank reads only its own objects, as upstream's `{tp_rank}` suffix does).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger(__name__)

MODULE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"
REGISTER = f"{MODULE}:MooncakeStore.register_mem_pool_host"
REGISTER_V2 = f"{MODULE}:MooncakeStore.register_mem_host_pool_v2"
BASE = "_sglang_l3_base_prefix"


def _pool_digest(pool: Any, name: str) -> str:
    """PoolLayout digest of one host pool (what its page bytes mean)."""
    from sglang_l3.storage.pagemap import PageMap

    try:
        return PageMap(pool, name).layout.digest()
    except Exception as e:  # noqa: BLE001 - a pool PageMap does not know: use its buffers
        logger.debug("sglang-l3 mooncake identity: PageMap(%s) failed (%s)", name, e)
        parts = [
            type(pool).__name__,
            str(getattr(pool, "layout", "")),
            str(getattr(pool, "page_size", "")),
        ]
        for attr in ("kv_buffer", "temporal_buffer", "conv_buffer"):
            bufs = getattr(pool, attr, None)
            for b in bufs if isinstance(bufs, (list, tuple)) else [bufs]:
                if b is not None and hasattr(b, "dtype"):
                    parts.append(f"{b.dtype}{tuple(b.shape)}")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]


def identity_prefix(store: Any) -> str:
    """`l3-<model>-<shard>-<pools>` for a MooncakeStore whose pools are registered."""
    from sglang_l3.storage.identity import identity_for

    model, shard = identity_for(getattr(store, "storage_config", None))
    pools: list[str] = []
    host = getattr(store, "mem_pool_host", None)
    if host is not None and getattr(host, "kv_buffer", None) is not None:
        pools.append("kv:" + _pool_digest(host, "kv"))
    for name, pool in sorted(getattr(store, "registered_pools", {}).items(), key=lambda kv: str(kv[0])):
        key = str(getattr(name, "value", name))
        pools.append(f"{key}:{_pool_digest(pool, key)}")
    layouts = hashlib.sha256("|".join(pools).encode()).hexdigest()[:8]
    return f"l3-{model.digest()}-{shard.name()}-{layouts}"


def apply(ctx: PatchContext) -> None:
    def retag(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
        if not hasattr(self, BASE):
            setattr(self, BASE, self.config_prefix)
        base = getattr(self, BASE)
        ident = identity_prefix(self)
        self.config_prefix = f"{base}_{ident}" if base else ident
        ctx.fired("key_prefix_set")
        logger.info("sglang-l3: Mooncake key prefix %s", self.config_prefix)

    ctx.after(REGISTER, retag)
    ctx.after(REGISTER_V2, retag)
