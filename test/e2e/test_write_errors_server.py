"""Issue 48 (second part): while page writes fail, they are attempted and counted;
once the fault ends, a finished request's pages reach L3 on an idle server with no
flush, and the next request's pages land too.

The fault is the one the issue saw: RLIMIT_FSIZE of 10,240 B on every process of a
TP=1 CPU server, so each page file (>= 20 KB) fails with EFBIG. Upstream's buffer-only
pipeline takes every acknowledged write for stored (its existence beliefs) and never
writes those pages again while it does; before the store retried failed pages, the
request's pages reached L3 only after a /flush_cache and a recompute, and the next
turn wrote only its own new pages above a hole. (The server's log file is past the
limit too, so its lines during the fault are lost; the test reads the published
counters and the store's files.)
"""

from __future__ import annotations

import resource
import subprocess
import time
from pathlib import Path

import pytest
from l3_e2e import (
    CHUNKED_PREFILL,
    NEW_TOKENS,
    PAGE_SIZE,
    PREFETCH_THRESHOLD,
    STARTUP_TIMEOUT,
    assert_same_output,
    published_counters,
)
from sglang_l3.storage.format import parse_page_name
from sglang_l3.testing.server import Server, ServerConfig, prompt

pytestmark = pytest.mark.e2e

LIMIT = 10240  # bytes (RLIMIT_FSIZE): the figure, below one page file


def kv_prefix_pages(store: Path, ids: list[int]) -> int:
    """KV pages of `ids` in the store, in order from the first."""
    from sglang.srt.mem_cache.utils import get_hash_str

    have = set()
    for p in (store / "pages").iterdir():
        n = parse_page_name(p.name)
        if n is not None and n.pool == "kv":
            have.add(n.key)
    keys = get_hash_str(ids[: len(ids) // PAGE_SIZE * PAGE_SIZE], None, page_size=PAGE_SIZE)
    return next((i for i, k in enumerate(keys) if k not in have), len(keys))


def until(fn, want, what: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    got = fn()
    while not want(got):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {got}")
        time.sleep(1.0)
        got = fn()
    return got


def set_fsize(pids: list[int], limits: dict[int, tuple[int, int]] | None) -> dict[int, tuple[int, int]]:
    """limits None: RLIMIT_FSIZE's soft limit LIMIT on each pid (returns the old ones);
    else put the given ones back."""
    old: dict[int, tuple[int, int]] = {}
    for pid in pids:
        try:
            old[pid] = resource.prlimit(pid, resource.RLIMIT_FSIZE)
            new = (LIMIT, old[pid][1]) if limits is None else limits[pid]
            resource.prlimit(pid, resource.RLIMIT_FSIZE, new)
        except (ProcessLookupError, KeyError):
            continue
    return old


def test_failed_page_writes_land_after_the_fault_without_a_flush(tmp_path, hash_extension_built) -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("the CPU server variant needs a machine without an accelerator")
    store, stats = tmp_path / "store", tmp_path / "stats"
    cfg = ServerConfig(
        storage_dir=str(store),
        chunked_prefill_size=CHUNKED_PREFILL,
        prefetch_threshold=PREFETCH_THRESHOLD,
        page_size=PAGE_SIZE,
        env={"SGLANG_L3_PUBLISH_STATS": "1", "SGLANG_L3_STATS_DIR": str(stats)},
    )
    a_ids = prompt(48, 900)
    a_pages = len(a_ids) // PAGE_SIZE  # 14: A's KV pages (its Mamba states come on top)
    with Server(cfg, tmp_path / "server.log", startup_timeout=STARTUP_TIMEOUT) as s:
        assert s.proc is not None
        pgrep = subprocess.run(["pgrep", "-g", str(s.proc.pid)], capture_output=True, text=True, check=False)
        pids = [int(p) for p in pgrep.stdout.split()]
        assert s.proc.pid in pids and len(pids) >= 3, pgrep  # launcher, tokenizer, scheduler, ...
        old = set_fsize(pids, None)
        try:
            a = s.generate(a_ids, NEW_TOKENS)
            assert len(a.output_ids) == NEW_TOKENS
            c = until(
                lambda: published_counters(stats),
                lambda c: c.get("store_write_errors", 0) >= a_pages,
                "A's page writes attempted and counted under the fault",
            )
            assert c.get("store_write_ok", 0) == 0, c
            assert kv_prefix_pages(store, a_ids) == 0
        finally:
            set_fsize(pids, old)
        # the fault is over; no request, no flush: A's pages reach L3 by themselves
        until(lambda: kv_prefix_pages(store, a_ids), lambda n: n == a_pages, "A's KV pages in L3 after the fault")
        c = until(
            lambda: published_counters(stats),
            lambda c: c.get("store_write_retried_ok", 0) >= a_pages,
            "A's pages written by the store's retry",
        )
        assert c.get("store_write_retry_dropped", 0) == 0, c
        # the next turn of the same conversation: its pages land without a flush
        b_ids = a_ids + a.output_ids + prompt(49, 200)
        b_pages = len(b_ids) // PAGE_SIZE  # its prompt's last 64-token boundary: its last Mamba state
        b = s.generate(b_ids, NEW_TOKENS)
        assert b.cached_device > 0, b.meta  # A's context was still on the device
        until(lambda: kv_prefix_pages(store, b_ids), lambda n: n == b_pages, "B's KV pages in L3")
        # and what landed restores exactly
        s.flush_cache()
        warm = s.generate(b_ids, NEW_TOKENS)
        assert warm.cached_device == 0 and warm.cached_storage == b_pages * PAGE_SIZE, warm.meta
        assert_same_output(warm, b, "cpu", "B restored from pages written after the fault")
