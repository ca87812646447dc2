"""SGLang's own unified-radix-cache kits, composed over every upstream config
(`define_config_test_classes`, as upstream composes them), with every sglang-l3
patch applied (test/conftest.py runs the plugin's register()).

A kit case that cannot run on CPU is skipped with its reason by the kit's own
`requires*` decorators; one that fails because of a patch is a patch bug."""

from __future__ import annotations

from array import array

import kit_shims  # noqa: F401  (before any kit use)
import torch
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, EvictParams
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.test.kits.unified_radix_cache.config import define_config_test_classes, requires_hicache
from sglang.test.kits.unified_radix_cache.fixtures import (
    build_fixture,
    match_prefix,
    node_host_value,
)
from sglang.test.kits.unified_radix_cache.load_back import UnifiedRadixCacheLoadBackFixtures
from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures


class KitSuite(UnifiedRadixCacheStorageFixtures, UnifiedRadixCacheLoadBackFixtures):
    def test_insert_match(self):
        cache, alloc, rtp = build_fixture(self.cfg)
        seq = self._make_seq(1, 4)
        self._insert(cache, alloc, rtp, seq)
        self.assertEqual(match_prefix(cache, seq).device_prefix_len, len(seq))
        cache.sanity_check()

    @requires_hicache
    def test_l2_backup_evict_load_back(self):
        """D→H backup, device eviction, H→D load back; KV bit-exact."""
        cache, alloc, rtp = self._build_hicache_fixture()
        seq = self._make_seq(1, 4)
        self._insert(cache, alloc, rtp, seq)
        leaf = match_prefix(cache, seq).last_device_node
        idx = cache.path_device_indices(leaf)
        self._fill_full_kv(alloc, idx, marker=5)
        k0, v0 = self._snapshot_full_kv(alloc, idx)
        self._backup_node(cache, leaf)
        self.assertIsNotNone(node_host_value(cache, leaf, ComponentType.FULL))
        cache.evict(EvictParams(num_tokens=len(seq) * 4, mamba_num=4 if self.cfg.has_mamba else 0))
        self.assertEqual(match_prefix(cache, seq).device_prefix_len, 0)
        self.assertGreater(match_prefix(cache, seq).host_hit_length, 0)
        self._load_back_through_admission(cache, rtp, seq)
        self._finish_pending_loads(cache)
        m2 = match_prefix(cache, seq)
        self.assertEqual(m2.device_prefix_len, len(seq))
        k1, v1 = self._snapshot_full_kv(alloc, cache.path_device_indices(m2.last_device_node))
        self.assertTrue(torch.equal(k0, k1) and torch.equal(v0, v1))

    @requires_hicache
    def test_l3_cache_mode_roundtrip(self):
        """Producer writes to L3 (file); a fresh consumer prefetches it (cache mode)."""
        self._skip_unsupported_hicache_test()
        storage_dir = self._make_storage_dir()
        seq = self._make_seq(1, 4)
        self._l3_produce(storage_dir, seq, marker=11)
        cons, _, _ = self._l3_consumer(storage_dir)
        self._consume_prefetch(cons, seq, CacheRequestHandle("l3", 0))
        m = match_prefix(cons, seq)
        self.assertEqual(m.host_hit_length + m.device_prefix_len, len(seq))

    @requires_hicache
    def test_l3_buffer_only_roundtrip(self):
        """buffer_only: producer → L3 (file); consumer stages + init_load_back; KV bit-exact.

        (The kit skips Mamba here; test/integration covers Mamba buffer-only.)"""
        storage_dir = self._make_storage_dir()
        seq = self._buffer_swa_seq()
        _, (ek, ev) = self._produce_buffer_l3(storage_dir, seq, marker=9)
        cons, cons_alloc, _ = self._build_buffer_hicache_fixture(storage_dir)
        req_id = CacheRequestHandle("buf", 0)
        cons.prefetch_from_storage(req_id, cons.root_node_handle(), array("q", seq), None, None)
        self._pump_hicache_until(
            cons,
            lambda: cons.check_prefetch_progress(req_id) and cons.buffer_pipeline.has_staged(req_id),
            "prefetch did not stage",
        )
        cons.pop_prefetch_loaded_tokens(req_id)
        spliced = self._consume_staged_prefetch(cons, req_id)
        self.assertEqual(int(spliced.numel()), len(seq))
        m = match_prefix(cons, seq)
        self.assertEqual(m.device_prefix_len, len(seq))
        k, v = self._snapshot_full_kv(cons_alloc, cons.path_device_indices(m.last_device_node))
        self.assertTrue(torch.equal(k, ek) and torch.equal(v, ev))


define_config_test_classes(KitSuite, globals())
