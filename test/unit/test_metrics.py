"""The one counter path (sglang_l3.metrics): store counters flow through inc(),
Prometheus export only when SGLang metrics are on, published snapshots of
processes that are gone (or whose pid was reused) expire, a burst's last
increments are published without waiting for the next one, and an older snapshot
never lands after a newer one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from sglang_l3 import metrics


@pytest.fixture
def stats_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_L3_STATS_DIR", str(tmp_path))
    return tmp_path


def test_store_counters_go_through_inc() -> None:
    c = metrics.Counters()
    before = metrics.get("store_unit_probe")
    c.inc("unit_probe", 3)
    assert c.get("unit_probe") == 3
    assert metrics.get("store_unit_probe") == before + 3
    assert metrics.store_counters()["unit_probe"] == before + 3


def test_storage_counters_is_the_same_path() -> None:
    import sglang_l3.storage

    assert sglang_l3.storage.counters is metrics.store_counters


def test_prometheus_only_when_sglang_metrics_are_enabled(monkeypatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics.inc("unit_prom_off")
    assert "unit_prom_off" not in metrics._PROM
    pytest.importorskip("prometheus_client")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent-but-set")
    monkeypatch.setattr(metrics, "_PROM", {})
    from prometheus_client import REGISTRY

    try:
        metrics.inc("unit_prom_on", "why")
        assert "unit_prom_on" in metrics._PROM
    finally:
        for m in metrics._PROM.values():
            REGISTRY.unregister(m)


def _write(path, pid: int, started, counters: dict) -> None:
    path.write_text(json.dumps({"pid": pid, "started": started, "time": time.time(), "counters": counters}))


def test_dead_process_counters_expire(stats_dir) -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    f = stats_dir / f"{p.pid}.json"
    _write(f, p.pid, 1.0, {"l3_restores": 7})
    assert metrics.collect_published().get("l3_restores", 0) == 0
    assert not f.exists()


def test_reused_pid_counters_expire(stats_dir) -> None:
    """A file whose pid is alive but belongs to a process started at another time
    (the pid was reused) is a dead server's: dropped."""
    pid = os.getppid()  # alive, and not the writer
    f = stats_dir / f"{pid}.json"
    _write(f, pid, 12345.0, {"l3_restores": 7})
    assert metrics.collect_published().get("l3_restores", 0) == 0
    assert not f.exists()
    _write(f, pid, metrics._start_time(pid), {"l3_restores": 7})
    assert metrics.collect_published()["l3_restores"] == 7


def test_last_increments_of_a_burst_are_published(stats_dir, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_L3_PUBLISH_STATS", "1")
    monkeypatch.setattr(metrics, "PUBLISH_INTERVAL_S", 0.2)
    metrics.inc("unit_burst")
    metrics.inc("unit_burst")  # within the interval: deferred, not dropped
    want = metrics.get("unit_burst")
    deadline = time.monotonic() + 30
    got = None
    path = stats_dir / f"{os.getpid()}.json"
    while time.monotonic() < deadline:
        if path.exists():  # both increments may have been deferred (an earlier publish)
            got = json.loads(path.read_text())["counters"].get("unit_burst")
            if got == want:
                break
        time.sleep(0.1)
    assert got == want


def test_an_older_snapshot_never_replaces_a_newer_one(stats_dir, monkeypatch) -> None:
    """Threads that count (the scheduler, the store's IO threads) publish side by side:
    a publish whose snapshot is older must not land after a newer one (the file would
    hold stale counters until the next increment)."""
    import threading

    real_replace = os.replace
    go = threading.Event()
    stalled = threading.Event()

    def replace(src, dst):  # publisher A stalls between its snapshot and its rename
        if threading.current_thread().name == "publisher-a":
            stalled.set()
            go.wait(30)
        real_replace(src, dst)

    metrics.inc("unit_order")  # not published: SGLANG_L3_PUBLISH_STATS is unset
    monkeypatch.setattr(metrics.os, "replace", replace)
    monkeypatch.setenv("SGLANG_L3_PUBLISH_STATS", "1")
    a = threading.Thread(target=metrics.publish_now, name="publisher-a")
    a.start()
    assert stalled.wait(30), "publisher A never reached its rename"
    monkeypatch.delenv("SGLANG_L3_PUBLISH_STATS")
    metrics.inc("unit_order")  # newer than A's snapshot, published only by B
    monkeypatch.setenv("SGLANG_L3_PUBLISH_STATS", "1")
    want = metrics.get("unit_order")
    b = threading.Thread(target=metrics.publish_now, name="publisher-b")
    b.start()
    b.join(0.5)  # without ordering, B lands now, before the stalled A
    go.set()
    a.join(30)
    b.join(30)
    got = json.loads((stats_dir / f"{os.getpid()}.json").read_text())["counters"]["unit_order"]
    assert got == want
