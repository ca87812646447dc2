"""Issue 49: a streamed hit that waits, parked, for device rows is retried every tick
(patch streamed-restore, `_device_fit`). It used to evict contexts each time although
free + evictable rows could not take it anyway (it waited all the same, and the
evicted contexts were lost for nothing), and to MIN-reduce its per-length restorable
flags (hit pages + 2 entries: 2 MiB at page size 1 and 256K tokens) on every tick,
beside the other agent's decode.

Real upstream stack on CPU, both tree cores: a context B sits evictable on the device,
running requests hold the rest, and the hit cannot fit even with B gone. Over many
ticks B stays, and the flags are reduced once (later retries reduce the fit alone);
once the running requests finish, the hit restores whole and every pool returns to
its baseline.
"""

from __future__ import annotations

import time

import pytest
from sglang_l3 import metrics
from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.testing.stack import TREE_CORES, HybridSpec, L3Stack, pump
from streamed_support import back_to_baseline

BUFFER = 256
PAGE = 64
CONTEXT = 8 * (BUFFER + PAGE)  # 2,560 tokens, 40 pages: streamed through a 320-token host pool
B = list(range(50_000, 50_000 + 4 * PAGE))


def _spec() -> HybridSpec:
    return HybridSpec(page_size=PAGE, kv_size=2 * CONTEXT + 1024, max_context_len=CONTEXT + 256)


def _stack(tmp_path, core: str) -> L3Stack:
    spec = _spec()
    return L3Stack(spec, str(tmp_path), tree_core=core, server_args={"hicache_ratio": BUFFER / spec.kv_size})


@pytest.mark.parametrize("core", TREE_CORES)
def test_a_parked_hit_evicts_nothing_for_nothing_and_reduces_its_flags_once(tmp_path, core: str) -> None:
    seq = list(range(11, 11 + CONTEXT))
    with _stack(tmp_path, core) as w:
        want = w.write(seq, marker=3.0)
        w.settle()
    with _stack(tmp_path, core) as st:
        st.write(B, marker=5.0)
        st.settle()
        assert st.match(B).device_prefix_len == len(B), "B must be on the device, evictable"
        # running requests hold all but what leaves the hit 4 pages short even with B evicted
        busy = st.allocator.alloc(st.allocator.available_size() - (CONTEXT - len(B) - 4 * PAGE))
        assert busy is not None
        sizes: list[int] = []
        reduce = st.cache._all_reduce

        def recording(t, op):
            sizes.append(t.numel())
            return reduce(t, op)

        st.cache._all_reduce = recording
        waited = metrics.get("l3_stream_restore", "waited_busy")
        h = st.start_prefetch(seq, "parked")
        lane = lane_of(st.cache.buffer_pipeline)
        pump(st.cache, lambda: metrics.get("l3_stream_restore", "waited_busy") > waited, "the hit to wait")
        for _ in range(30):
            st.cache.check_hicache_events()
        assert h not in lane.streams and st.cache.buffer_pipeline.pending_hit_allocs, "the hit must still wait"
        flags = CONTEXT // PAGE + 2  # the restorable flags of every length + the fit
        assert sizes.count(flags) == 1, f"the flags were reduced {sizes.count(flags)} times while parked"
        assert st.match(B).device_prefix_len == len(B), "a waiting hit evicted B although it could not fit"
        st.allocator.free(busy)  # the running requests finish
        st.scribble()
        pump(
            st.cache,
            lambda: st.cache.check_prefetch_progress(h) and st.cache.buffer_pipeline.has_staged(h),
            "the hit to stream and stage",
        )
        assert st.cache.pop_prefetch_loaded_tokens(h) == CONTEXT
        req, loaded = st.admit(h, seq, "parked")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)


def test_hits_parked_behind_a_waiting_hit_keep_their_timeout_budget(tmp_path) -> None:
    """Upstream retries parked hits in order, so a hit waiting for device rows holds
    every L3 hit behind it. With `--hicache-storage-prefetch-policy timeout` the head's
    budget restarted while it waited, but not theirs: a small hit behind it expired and
    recomputed. Now theirs restart too; once rows free, both restore."""
    seq = list(range(11, 11 + CONTEXT))
    small = list(range(70_000, 70_000 + 4 * PAGE))
    with _stack(tmp_path, "rust") as w:
        w.write(seq, marker=3.0)
        w.write(small, marker=6.0)
        w.settle()
    with _stack(tmp_path, "rust") as st:
        cache = st.cache
        cache.prefetch_stop_policy = "timeout"
        cache.prefetch_timeout_base, cache.prefetch_timeout_per_page = 0.3, 0.0
        busy = st.allocator.alloc(st.allocator.available_size() - CONTEXT // 2)
        assert busy is not None
        waited = metrics.get("l3_stream_restore", "waited_busy")
        head = st.start_prefetch(seq, "head")
        pump(cache, lambda: metrics.get("l3_stream_restore", "waited_busy") > waited, "the head to wait")
        behind = st.start_prefetch(small, "behind")
        pump(cache, lambda: len(cache.buffer_pipeline.pending_hit_allocs) == 2, "the small hit to park behind")
        deadline = time.monotonic() + 4 * cache.prefetch_timeout_base
        while time.monotonic() < deadline:  # admission polls both, past a whole budget
            cache.check_hicache_events()
            assert not cache.check_prefetch_progress(head), "the waiting head was stopped"
            assert not cache.check_prefetch_progress(behind), "the hit parked behind it expired"
            time.sleep(0.01)
        cache.prefetch_stop_policy = "wait_complete"  # the reads themselves are not under test
        st.allocator.free(busy)
        for h, ids in ((head, seq), (behind, small)):
            pump(
                cache,
                lambda h=h: cache.check_prefetch_progress(h) and cache.buffer_pipeline.has_staged(h),
                "the hit to stage",
            )
            assert cache.pop_prefetch_loaded_tokens(h) == len(ids)
            cache.buffer_pipeline.release_staged_hold(h)
        back_to_baseline(st)
