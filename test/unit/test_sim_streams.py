"""The simulated asynchronous device (`sglang_l3.sim.streams`): queue order,
events as queue positions, waits from the default stream drain, waits from another
stream queue barriers, seeded polls, DMA-like deferred transfers, and the patch
`cpu-sim-streams` that installs it only when asked."""

from __future__ import annotations

import threading

import pytest
import torch
from sglang_l3.sim import streams as sim


@pytest.fixture
def dev():
    sim.install(seed=7)
    try:
        yield sim
    finally:
        sim.uninstall()


def _log_op(log: list, tag: str):
    return lambda: log.append(tag)


def test_default_stream_runs_at_once_other_streams_queue(dev) -> None:
    log: list = []
    s = torch.cpu.Stream()
    assert isinstance(s, sim.SimStream) and torch.cpu.current_stream().default
    sim.enqueue(_log_op(log, "default"))
    assert log == ["default"]
    with torch.cpu.stream(s):
        assert torch.cpu.current_stream() is s
        sim.enqueue(_log_op(log, "a"), "a")
        sim.enqueue(_log_op(log, "b"), "b")
    assert log == ["default"] and s.pending() == ["a", "b"] and not s.query()
    s.synchronize()
    assert log == ["default", "a", "b"] and s.query() and s.pending() == []


def test_event_marks_a_queue_position(dev) -> None:
    log: list = []
    s = torch.cpu.Stream()
    s.enqueue(_log_op(log, 1))
    ev = torch.cpu.Event()
    ev.record(s)
    s.enqueue(_log_op(log, 2))
    assert not ev.done()
    ev.synchronize()
    assert log == [1] and ev.done() and s.pending() == ["work"]
    # An event never recorded is complete (as on CUDA).
    assert torch.cpu.Event().query()
    # Recording on the default stream marks work already done.
    ev2 = torch.cpu.Event()
    ev2.record()
    assert ev2.done()


def test_wait_from_default_stream_drains(dev) -> None:
    log: list = []
    s = torch.cpu.Stream()
    s.enqueue(_log_op(log, 1))
    ev = s.record_event()
    s.enqueue(_log_op(log, 2))
    torch.cpu.current_stream().wait_event(ev)
    assert log == [1]
    torch.cpu.current_stream().wait_stream(s)
    assert log == [1, 2]


def test_wait_from_another_stream_queues_a_barrier(dev) -> None:
    log: list = []
    load, fwd = torch.cpu.Stream(), torch.cpu.Stream()
    load.enqueue(_log_op(log, "copy"))
    ev = load.record_event()
    load.enqueue(_log_op(log, "later copy"))
    fwd.wait_event(ev)  # queued: nothing runs yet
    fwd.enqueue(_log_op(log, "read"))
    assert log == [] and fwd.pending() == ["barrier", "work"]
    fwd.synchronize()  # the barrier drains the load stream up to the event only
    assert log == ["copy", "read"] and load.pending() == ["work"]
    # wait_stream: everything queued on `load` so far, not what comes after.
    fwd.wait_stream(load)
    load.enqueue(_log_op(log, "after"))
    fwd.enqueue(_log_op(log, "read2"))
    fwd.synchronize()
    assert log == ["copy", "read", "later copy", "read2"] and load.pending() == ["work"]


def test_device_synchronize_drains_every_stream(dev) -> None:
    log: list = []
    streams = [torch.cpu.Stream() for _ in range(3)]
    for i, s in enumerate(streams):
        s.enqueue(_log_op(log, i))
    torch.cpu.synchronize()
    assert sorted(log) == [0, 1, 2] and not sim.pending()


def _polls(seed: int, n: int = 40) -> list[bool]:
    sim.install(seed=seed)
    try:
        out = []
        s = torch.cpu.Stream()
        for _ in range(n):
            s.enqueue(lambda: None)
            out.append(s.record_event().query())
        return out
    finally:
        sim.uninstall()


def test_query_completes_with_a_seeded_probability() -> None:
    a, b = _polls(1), _polls(1)
    assert a == b, "the same seed gives the same polls"
    assert any(a) and not all(a), "some polls lag, some complete"
    assert _polls(2) != a, "another seed, another run"


def test_query_extremes() -> None:
    for p, expect in ((0.0, False), (1.0, True)):
        sim.install(seed=0, p_complete=p)
        try:
            s = torch.cpu.Stream()
            s.enqueue(lambda: None)
            ev = s.record_event()
            assert [ev.query() for _ in range(20)] == [expect] * 20
            ev.synchronize()
            assert ev.query()
        finally:
            sim.uninstall()


def test_current_stream_is_per_thread(dev) -> None:
    s = torch.cpu.Stream()
    seen: list = []
    with torch.cpu.stream(s):
        t = threading.Thread(target=lambda: seen.append(torch.cpu.current_stream()))
        t.start()
        t.join()
        assert torch.cpu.current_stream() is s
    assert seen[0].default and torch.cpu.current_stream().default


def test_deferred_copies_indices_at_issue_and_data_by_reference(dev) -> None:
    src = torch.arange(8, dtype=torch.float32)
    dst = torch.zeros(8)

    def copy(dst_t, src_t, idx):
        dst_t[idx] = src_t[idx]

    qcopy = sim.deferred(copy, "copy")
    idx = torch.tensor([1, 2])
    s = torch.cpu.Stream()
    with torch.cpu.stream(s):
        qcopy(dst, src, idx)
        qcopy(dst, src, idx)  # the same indices for a second launch (one layer after another)
    idx[:] = torch.tensor([5, 6])  # the caller reuses its index tensor
    src[1] = 100.0  # the source changes before the DMA runs
    assert dst.sum() == 0 and s.pending() == ["copy", "copy"]
    s.synchronize()
    assert dst[1] == 100.0 and dst[2] == 2.0 and dst[5] == 0 and dst[6] == 0
    with torch.cpu.stream(s):
        qcopy(dst, src, idx)  # written in place since its last launch: snapshotted anew
    idx[:] = torch.tensor([3, 4])
    s.synchronize()
    assert dst[5] == 5.0 and dst[6] == 6.0 and dst[3] == 0 and dst[4] == 0
    qcopy(dst, src, torch.tensor([7]))  # the default stream: at once
    assert dst[7] == 7.0


def test_uninstall_drains_and_restores_torch_cpu() -> None:
    before = torch.cpu.Stream, torch.cpu.Event, torch.cpu.current_stream
    sim.install(seed=3)
    log: list = []
    torch.cpu.Stream().enqueue(_log_op(log, "x"))
    sim.uninstall()
    assert log == ["x"]
    assert (torch.cpu.Stream, torch.cpu.Event, torch.cpu.current_stream) == before
    assert not sim.installed()


def test_patch_applies_only_when_asked(monkeypatch) -> None:
    from sglang_l3.patches.cpu import sim_streams as cpu_sim_streams

    monkeypatch.delenv("SGLANG_L3_SIM_STREAMS", raising=False)
    assert "not set" in (cpu_sim_streams.applicable() or "")
    monkeypatch.setenv("SGLANG_L3_SIM_STREAMS", "seven")
    with pytest.raises(ValueError, match="integer seed"):
        cpu_sim_streams.applicable()


def test_seeds_follow_the_variable(monkeypatch) -> None:
    """Started with SGLANG_L3_SIM_STREAMS=N the integration tests run under seed N only;
    a malformed or threaded value is an error, not a silent default."""
    from sglang_l3.sim.harness import SEEDS, seeds

    monkeypatch.delenv("SGLANG_L3_SIM_STREAMS", raising=False)
    assert seeds() == SEEDS
    monkeypatch.setenv("SGLANG_L3_SIM_STREAMS", "7")
    assert seeds() == (7,)
    monkeypatch.setenv("SGLANG_L3_SIM_STREAMS", "7:threaded")
    with pytest.raises(ValueError, match="queued device"):
        seeds()
    monkeypatch.setenv("SGLANG_L3_SIM_STREAMS", "x")
    with pytest.raises(ValueError, match="integer seed"):
        seeds()


def test_simulated_device_starts_fresh_over_one_applied_at_startup(monkeypatch) -> None:
    """A process started with the variable set has the patch applied: a block gets a
    fresh device of its own seed, and none is left installed after it."""
    from sglang_l3.patches import framework
    from sglang_l3.sim.harness import PATCH_ID, simulated_device

    monkeypatch.setenv("SGLANG_L3_SIM_STREAMS", "3")
    framework.apply_one(next(s for s in framework.load_series() if s.id == PATCH_ID))
    assert sim.stats()["seed"] == 3
    with simulated_device(4):
        assert sim.stats() == {"seed": 4, "polls": 0, "lagged": 0, "device_reads": 0}
    assert not sim.installed()


def test_p_complete_is_checked() -> None:
    sim.install(seed=0)
    try:
        assert sim.set_p_complete(0.5) == sim.P_COMPLETE
        with pytest.raises(ValueError, match="p_complete"):
            sim.set_p_complete(0.0)
    finally:
        sim.uninstall()


def test_held_acks_lag_until_released_a_sync_still_runs(dev) -> None:
    """hold_acks(True): every poll of a pending event is False (however many); released,
    polls complete it again; a synchronize runs the work even while held."""
    log: list = []
    s = torch.cpu.Stream()
    with torch.cpu.stream(s):
        sim.enqueue(_log_op(log, "a"), "a")
        ev = torch.cpu.Event()
        ev.record()
        sim.enqueue(_log_op(log, "b"), "b")
        ev2 = torch.cpu.Event()
        ev2.record()
    assert sim.hold_acks(True) is False
    assert not any(ev.query() for _ in range(200)) and log == []
    ev.synchronize()
    assert log == ["a"] and ev.query()
    assert sim.hold_acks(False) is True
    assert any(ev2.query() for _ in range(200)) and log == ["a", "b"]


def test_simulated_device_queues_host_pool_transfers() -> None:
    """Through the patch: a host-pool load on a side stream is queued, runs at sync."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang_l3.sim.harness import simulated_device

    plain = MHATokenToKVPoolHost.load_to_device_per_layer
    with simulated_device(5):
        assert sim.installed() and MHATokenToKVPoolHost.load_to_device_per_layer is not plain
        assert sim.stats()["seed"] == 5
    assert not sim.installed() and MHATokenToKVPoolHost.load_to_device_per_layer is plain


def test_threaded_device_runs_queued_work_by_itself() -> None:
    """Threaded mode (the stall benchmark's copy engine): work queued on a side stream
    completes without anyone waiting, in issue order, barriers included; waits from
    the default stream block until the device thread got there."""
    import time

    sim.install(seed=0, threaded=True)
    try:
        log: list = []
        gate = threading.Event()
        load, fwd = torch.cpu.Stream(), torch.cpu.Stream()
        load.enqueue(lambda: (gate.wait(30), log.append("copy")))
        ev = load.record_event()
        fwd.wait_event(ev)
        fwd.enqueue(lambda: log.append("read"))
        assert not ev.query() and log == []  # the copy is held: nothing ran out of order
        gate.set()
        deadline = time.monotonic() + 30
        while not ev.query() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ev.query()
        torch.cpu.current_stream().wait_stream(fwd)
        assert log == ["copy", "read"]
    finally:
        sim.uninstall()
    assert not sim.installed()


def test_event_probe_cached_under_the_simulator_holds_after_it() -> None:
    """Upstream caches whether the device's Event takes `enable_timing`
    (l2_transfer._timing_events_supported, @cache). The simulator answers as
    torch.cpu does, so a probe made under it does not break every later test in the
    process ("Event() takes no arguments" when the next stack is built)."""
    from sglang.srt.mem_cache import l2_transfer

    l2_transfer._timing_events_supported.cache_clear()
    sim.install(seed=3)
    try:
        *_, timed = l2_transfer.make_timing_event_pair()
        assert not timed
    finally:
        sim.uninstall()
    l2_transfer.make_timing_event_pair()  # torch.cpu.Event again: must not raise
    with pytest.raises(TypeError):
        sim.SimEvent(enable_timing=True)
