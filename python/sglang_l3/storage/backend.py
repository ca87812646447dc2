"""L3FileStore: the `file` HiCache storage backend (patch `store-file`).

Implements upstream's HiCacheStorage interface - v2 (batch_exists_v2 /
batch_get_v2 / batch_set_v2, used for KV + Mamba pools of hybrid models), v1
zero-copy (batch_get_v1 / batch_set_v1, used for the KV pool once the patch
selects the zero-copy page functions), and the legacy get/set API - on top of
PageStore. Semantics mirror HiCacheFile (sglang.srt.mem_cache.hicache_storage) so the
controller's MIN-reduce across TP ranks sees the same shapes of answers; what
changes is the file format (self-describing, checksummed), the IO (batched,
parallel, zero-copy, optional O_DIRECT), the budget and the failure modes:
no call here raises into the scheduler - a failure is a miss / False.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.identity import PoolLayout, identity_for
from sglang_l3.storage.pagemap import PageMap, Target, flat_tensor_target
from sglang_l3.storage.pending_writes import Page, PendingWrites
from sglang_l3.storage.store import PageStore, PoolSpec, ReadItem, WriteItem

logger = logging.getLogger(__name__)

KV = PoolName.KV.value
MAMBA = PoolName.MAMBA.value
_EXISTS_CHUNK = 64
# How long a lookup waits for a queued write of a page it asks for (pending_writes.py):
# a write at disk speed takes milliseconds; past this the page is a miss, as before.
LOOKUP_WAIT_S = 10.0


def pool_key(name: Any) -> str:
    # PoolName is a str Enum whose hash is the member name: normalize to value.
    return name.value if isinstance(name, Enum) else str(name)


def _never_raise(fallback: Callable[..., Any]):
    """Storage errors become misses, never exceptions in scheduler threads."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except Exception:
                logger.exception("sglang-l3 store: %s failed; treated as a miss", fn.__name__)
                self.store.counters.inc("api_errors")
                return fallback(*args, **kwargs)

        return wrapper

    return deco


def _chain(keys: list[str], prefix_keys: list[str] | None) -> list[tuple[str | None, int]]:
    """(prior key, depth) per key: prefix_keys + keys is one contiguous chain."""
    if prefix_keys is None:
        prior0, depth0 = None, -1
    else:
        prior0, depth0 = (prefix_keys[-1] if prefix_keys else ""), len(prefix_keys)
    return [(prior0 if i == 0 else keys[i - 1], depth0 + i if depth0 >= 0 else -1) for i in range(len(keys))]


def _false_lists(transfers: list[PoolTransfer], *_a, **_k) -> dict:
    return {t.name: [False] * len(t.keys or []) for t in transfers or []}


class L3FileStore(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, file_path: str | None = None):
        self.storage_config = storage_config
        self.settings = StoreSettings.resolve(storage_config.extra_config, explicit_dir=file_path)
        self.model, self.shard = identity_for(storage_config, override=self.settings.model_identity)
        self.is_mla = bool(storage_config.is_mla_model)
        self.store = PageStore(
            self.settings,
            self.model,
            self.shard,
            replicated_writer=(not self.is_mla) or storage_config.is_storage_writer,
        )
        self.file_path = str(self.store.root)
        self._maps: dict[str, PageMap] = {}
        self._specs: dict[str, PoolSpec] = {}
        self._warned: set[str] = set()
        # per batch since the last get_stats(): (pages moved, GB/s), bounded
        self._io_stats: dict[bool, collections.deque] = {w: collections.deque(maxlen=4096) for w in (False, True)}
        self._stats_lock = threading.Lock()
        self.pending_writes = PendingWrites()

    # ------------------------------------------------------------ registry
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._register(mem_pool_host, KV)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register(host_pool, pool_key(host_pool_name))

    def _register(self, pool: Any, name: str) -> None:
        existing = self._maps.get(name)
        if existing is not None and existing.pool is pool:
            return
        try:
            pm = PageMap(pool, name)
            # Mirrors HiCacheFile: MLA pools are TP-replicated, Mamba state is not.
            spec = self.store.pool_spec(pm.layout, replicated=self.is_mla and name != MAMBA)
        except Exception as e:
            logger.error("sglang-l3 store: pool %s cannot be stored (%s); its pages will miss", name, e)
            self._maps.pop(name, None)
            self._specs.pop(name, None)
            return
        self._maps[name] = pm
        self._specs[name] = spec
        logger.info(
            "sglang-l3 store: pool %s: %d-byte pages (%s, %s)",
            name,
            spec.payload_len,
            pm.layout.layout,
            "zero-copy" if pm.zero_copy else "copy path",
        )

    def pool_layout(self, name: Any) -> PoolLayout | None:
        spec = self._specs.get(pool_key(name))
        return spec.layout if spec else None

    def _warn_once(self, tag: str, msg: str, *args: Any) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            logger.warning(msg, *args)

    # ------------------------------------------------------ queued writes
    def expect_writes(self, pages: list[Page]) -> None:
        """`pages` ((pool, key)) are queued for a write: lookups of them wait for it."""
        self.pending_writes.add(pages)

    def writes_finished(self, pages: list[Page]) -> None:
        """The write `expect_writes(pages)` announced ended (written or not)."""
        self.pending_writes.remove(pages)

    def _present(self, keys: list[str], spec: PoolSpec) -> list[bool]:
        waited = self.pending_writes.wait([(spec.layout.pool, k) for k in keys], LOOKUP_WAIT_S)
        if waited is not None:
            self.store.counters.inc("exists_waited_write")
            if not waited:
                self.store.counters.inc("exists_wait_timeouts")
        return self.store.exists([(k, spec) for k in keys])

    # ----------------------------------------------------------- existence
    def _exists_prefix(self, keys: list[str], spec: PoolSpec) -> int:
        n = 0
        for i in range(0, len(keys), _EXISTS_CHUNK):
            have = self._present(keys[i : i + _EXISTS_CHUNK], spec)
            for h in have:
                if not h:
                    return n
                n += 1
        return n

    @_never_raise(lambda *a, **k: PoolTransferResult.empty())
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        kv = self._specs.get(KV)
        if kv is None:
            return PoolTransferResult.empty()
        kv_pages = self._exists_prefix(keys, kv)
        hit_count: dict = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            spec = self._specs.get(pool_key(t.name))
            if spec is None:
                self._warn_once(f"unreg:{t.name}", "sglang-l3 store: pool %s not registered; no hit", t.name)
                restorable = []
                break
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = self._exists_prefix(keys[:kv_pages], spec)
                pool_ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                have = self._present(keys[:kv_pages], spec)
                pool_ok = {p for p in range(1, kv_pages + 1) if all(have[i] for i in range(max(0, p - trailing), p))}
                boundary = max(pool_ok, default=0)
            else:  # e.g. BLOCK_GROUPS: unused by 0.5.23's callers; never over-promise
                self._warn_once(
                    f"policy:{t.hit_policy}", "sglang-l3 store: hit policy %s unsupported; no hit", t.hit_policy
                )
                restorable = []
                break
            if boundary:
                hit_count[t.name] = boundary
            restorable = [p for p in restorable if p in pool_ok]
        final = restorable[-1] if restorable else 0
        return PoolTransferResult(final, hit_count, restorable)

    # ------------------------------------------------------------------ io
    def _plan(
        self,
        name: str,
        keys: list[str],
        host_indices: torch.Tensor | None,
        write: bool,
        prefix_keys: list[str] | None,
    ) -> list[tuple[Any, Target]] | None:
        pm, spec = self._maps.get(name), self._specs.get(name)
        if pm is None or spec is None:
            self._warn_once(f"unreg:{name}", "sglang-l3 store: pool %s not registered; IO fails", name)
            return None
        expected = len(keys) * pm.page_size
        if host_indices is None or host_indices.numel() != expected:
            logger.error(
                "sglang-l3 store: %s indices length mismatch for %s: expected %d, got %s",
                "write" if write else "read",
                name,
                expected,
                host_indices.numel() if host_indices is not None else 0,
            )
            return None
        idx = host_indices.tolist()
        plan: list[tuple[Any, Target]] = []
        chain = _chain(keys, prefix_keys) if write else None
        for i, key in enumerate(keys):
            index = int(idx[i * pm.page_size])
            if chain is not None:  # a write
                t = pm.source(index)
                prior, depth = chain[i]
                plan.append((WriteItem(key, spec, t.runs, prior, depth), t))
            else:
                t = pm.target(index)
                plan.append((ReadItem(key, spec, t.runs), t))
        return plan

    def _run(
        self,
        requests: list[tuple[Any, str, list[str], torch.Tensor | None]],
        write: bool,
        prefix_keys: list[str] | None,
    ) -> dict:
        """One engine call for every page of every pool in the batch."""
        out: dict = {}
        items: list = []
        spans: list = []
        for rkey, name, keys, host_indices in requests:
            plan = self._plan(name, keys, host_indices, write, prefix_keys)
            if plan is None:
                out[rkey] = [False] * len(keys)
                continue
            spans.append((rkey, len(items), plan))
            items.extend(it for it, _ in plan)
        if items:
            t0 = time.perf_counter()
            res = self.store.write(items) if write else self.store.read(items)
            self._record_batch(items, res, time.perf_counter() - t0, write)
            for rkey, start, plan in spans:
                r = res[start : start + len(plan)]
                if not write:
                    for j, (_, t) in enumerate(plan):
                        if r[j] and t.commit is not None:
                            try:
                                t.commit()
                            except Exception as e:
                                logger.error("sglang-l3 store: copying a page into pool failed: %s", e)
                                r[j] = False
                out[rkey] = r
        return out

    def _v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None, write: bool) -> dict:
        prefix = extra_info.prefix_keys if extra_info is not None else None
        reqs = [(t.name, pool_key(t.name), list(t.keys or []), t.host_indices) for t in transfers]
        return self._run(reqs, write, prefix)

    @_never_raise(_false_lists)
    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, extra_info, write=False)

    @_never_raise(_false_lists)
    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, extra_info, write=True)

    @_never_raise(lambda keys, *a, **k: [False] * len(keys))
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._run([(KV, KV, list(keys), host_indices)], False, None)[KV]

    @_never_raise(lambda keys, *a, **k: [False] * len(keys))
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return self._run([(KV, KV, list(keys), host_indices)], True, prefix)[KV]

    # -------------------------------------------------------- legacy API
    def _flat_spec(self, t: torch.Tensor) -> PoolSpec:
        kv = self._specs.get(KV)
        nbytes = t.numel() * t.element_size()
        if kv is not None and nbytes == kv.payload_len:
            return kv
        raw = PoolLayout(
            pool=KV,
            layout="raw",
            page_size=0,
            components=((str(t.dtype).replace("torch.", ""), (t.numel(),)),),
            payload_bytes=nbytes,
        )
        return self.store.pool_spec(raw, replicated=self.is_mla)

    @_never_raise(lambda keys, *a, **k: [None] * len(keys))
    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        if not target_locations:
            return [None] * len(keys)
        items = [
            ReadItem(k, self._flat_spec(t), flat_tensor_target(t)) for k, t in zip(keys, target_locations, strict=False)
        ]
        res = self.store.read(items)
        return [t if ok else None for t, ok in zip(target_locations, res, strict=False)]

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    @_never_raise(lambda *a, **k: False)
    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if values is None:
            return False
        vals = [v.contiguous() for v in values]
        items = [WriteItem(k, self._flat_spec(v), flat_tensor_target(v)) for k, v in zip(keys, vals, strict=False)]
        return all(self.store.write(items)) and len(items) == len(keys)

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value] if value is not None else None)

    @_never_raise(lambda *a, **k: False)
    def exists(self, key: str) -> bool:
        kv = self._specs.get(KV)
        return kv is not None and self._present([key], kv)[0]

    @_never_raise(lambda *a, **k: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        kv = self._specs.get(KV)
        return self._exists_prefix(list(keys), kv) if kv is not None else 0

    # --------------------------------------------------------------- admin
    def clear(self) -> bool:
        try:
            n = self.store.clear_own()
            logger.info("sglang-l3 store: cleared %d pages of this rank", n)
            return True
        except Exception as e:
            logger.error("sglang-l3 store: clear failed: %s", e)
            return False

    def counters(self) -> dict:
        return self.store.counters.snapshot()

    def _record_batch(self, items: list, res: list[bool], seconds: float, write: bool) -> None:
        pages = sum(1 for ok in res if ok)
        if not pages:
            return
        nbytes = sum(it.spec.payload_len for it, ok in zip(items, res, strict=True) if ok)
        with self._stats_lock:
            self._io_stats[write].append((pages, nbytes / max(seconds, 1e-9) / 1e9))

    def get_stats(self) -> Any:
        """Upstream's StorageMetrics (read by the cache when --enable-metrics):
        pages per batch and GB/s per batch since the last call, prefetch = reads,
        backup = writes. Our own counters: counters() / sglang_l3.metrics."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        with self._stats_lock:
            for write, pgs, bw in (
                (False, out.prefetch_pgs, out.prefetch_bandwidth),
                (True, out.backup_pgs, out.backup_bandwidth),
            ):
                for pages, gbps in self._io_stats[write]:
                    pgs.append(pages)
                    bw.append(gbps)
                self._io_stats[write].clear()
        return out

    def close(self) -> None:
        self.pending_writes.clear()  # no lookup waits on a write that will not come
        self.store.close()
