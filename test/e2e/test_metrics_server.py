"""sglang-l3's counters at SGLang's own `/metrics` (`--enable-metrics`) and in
`sglang-l3 doctor --stats`, read from a live CPU server after an L3 restore."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from l3_e2e import (
    CHUNKED_PREFILL,
    NEW_TOKENS,
    P_LEN,
    PAGE_SIZE,
    PREFETCH_THRESHOLD,
    STARTUP_TIMEOUT,
    P,
    assert_same_output,
    restorable,
)
from sglang_l3.testing.server import CRASH_DIAGNOSTICS_LINE, Server, ServerConfig

pytestmark = pytest.mark.e2e

_LINE = re.compile(r'^sglang_l3_(\w+)_total\{reason="([^"]*)"\}\s+([0-9.eE+-]+)$')


def prom_counters(text: str) -> dict[str, float]:
    """sglang_l3_<name>_total{reason=...} -> {"name" or "name{reason}": value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            name, reason, value = m.groups()
            out[f"{name}{{{reason}}}" if reason else name] = float(value)
    return out


def doctor_stats(stats_dir: str) -> dict[str, float]:
    env = dict(os.environ, SGLANG_L3_STATS_DIR=stats_dir)
    out = subprocess.run(
        [sys.executable, "-m", "sglang_l3.cli", "doctor", "--json", "--stats"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    rep = json.loads(out.stdout)
    return next(c for c in rep["checks"] if c["name"] == "stats")["data"]


def until(fn, want, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = fn()
        if want(got):
            return got
        time.sleep(1.0)
    raise AssertionError(f"{what}: {got}")


def test_counters_at_metrics_and_in_doctor_after_a_restore(tmp_path, hash_extension_built) -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("the CPU server variant needs a machine without an accelerator")
    stats_dir = str(tmp_path / "stats")
    cfg = ServerConfig(
        storage_dir=str(tmp_path / "store"),
        chunked_prefill_size=CHUNKED_PREFILL,
        prefetch_threshold=PREFETCH_THRESHOLD,
        page_size=PAGE_SIZE,
        extra_args=["--enable-metrics"],
        env={"SGLANG_L3_PUBLISH_STATS": "1", "SGLANG_L3_STATS_DIR": stats_dir},
    )
    with Server(cfg, tmp_path / "server.log", startup_timeout=STARTUP_TIMEOUT) as s:
        cold = s.generate(P, NEW_TOKENS)
        s.flush_cache()
        warm = s.generate(P, NEW_TOKENS)
        assert warm.cached_storage == restorable(P_LEN), warm.meta
        assert_same_output(warm, cold, "cpu", "P after /flush_cache")
        pages = restorable(P_LEN) // PAGE_SIZE  # KV pages of the restored prefix

        def settled(c: dict) -> bool:
            return c.get("l3_restores") == 1 and c.get("store_read_hits", 0) >= pages

        prom = until(lambda: prom_counters(s.get_text("/metrics")), settled, "/metrics counters")
        # one restore, re-anchored by the patch, nothing fell back or stopped
        assert prom["l3_restores"] == 1
        assert not any(k.startswith(("recompute_fallbacks", "fail_stops")) for k in prom), prom
        # the store served every page it was asked for: the prefix's KV pages and
        # one Mamba state page, none missing, none bad
        assert prom["store_read_hits"] == prom["store_read_pages"] == pages + 1, prom
        assert prom.get("store_read_errors", 0) == 0 and prom.get("quarantined", 0) == 0
        assert prom["store_write_ok"] >= pages + 1
        # upstream's own storage histograms are fed by L3FileStore.get_stats()
        text = s.get_text("/metrics")
        assert re.search(r"^sglang:prefetch_pgs_count\{.*\} [1-9]", text, re.M), "get_stats() fed nothing"

        # doctor --stats: the same values, read from the published snapshot
        stats = until(
            lambda: doctor_stats(stats_dir),
            lambda d: d.get("store_read_hits") == prom["store_read_hits"],
            "doctor --stats",
        )
        for key in ("l3_restores", "store_read_hits", "store_read_pages", "store_write_ok"):
            assert stats[key] == prom[key], (key, stats, prom)
    # the harness's stop is not a crash: no 5 s wait for crash diagnostics (ServerConfig.crash_diagnostics)
    assert CRASH_DIAGNOSTICS_LINE not in s.log_text(), s.log_tail(20)
    # the server is gone: its counters expire
    assert doctor_stats(stats_dir).get("l3_restores", 0) == 0
