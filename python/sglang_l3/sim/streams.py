"""A simulated asynchronous device for CPU runs (tests only).

Without an accelerator upstream's `get_device_module()` is `torch.cpu`, whose
`Stream`/`Event` do nothing and whose `Event.query()` is always true: every copy
lands the moment it is issued, so a missing fence, wait or event is invisible.
This module gives `torch.cpu` a device that behaves like a GPU's streams:

- work on the default stream runs at once (the scheduler thread's eager work);
- work on any other stream is queued, in order, and runs only when something
  needs it: `synchronize()` (stream, event or device), a `wait_stream`/`wait_event`
  issued from the default stream, a barrier another stream reaches, or a poll;
- an event marks a queue position (`record`); a `wait_event`/`wait_stream` issued
  from a non-default stream queues a barrier there, which drains the other stream
  up to the marked position when the barrier itself runs;
- `Event.query()` on a pending event completes it (runs its stream up to the mark)
  with a seeded probability, else returns False: acks lag a random number of polls.

What is queued: the host pools' transfer methods (`sglang_l3.patches.cpu.sim_streams`
wraps them with `deferred`), and closures a harness queues with `enqueue` (a
simulated forward pass). Other torch work runs at once, whatever the stream: only
code whose device work is queued explicitly is stream-ordered here, which is why
this is for the cache-stack harnesses, not for a served model.

Opt-in only: `SGLANG_L3_SIM_STREAMS=<seed>` with the CPU switch (patch
`cpu-sim-streams`), or `install(seed)` in a test.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from sglang_l3 import faults

P_COMPLETE = 0.3  # chance that polling a pending event finds it complete


class SimDeadlock(RuntimeError):
    """A stream asked to run past the op it is running (cannot happen while every
    wait names work issued before it; kept as a guard)."""


class _Device:
    def __init__(self, seed: int, p_complete: float, threaded: bool) -> None:
        self.seed = seed
        self.p_complete = p_complete
        self.held = False  # hold_acks: polls of pending events find nothing complete
        self.rng = random.Random(seed)
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.tls = threading.local()
        self.busy: set[SimStream] = set()  # streams with queued work stay alive, as on a device
        self.default = SimStream(_device=self, _default=True)
        self.seq = 0  # issue order of queued work, over all streams
        self.polls = 0  # Event.query() calls on pending events
        self.lagged = 0  # ... that returned False
        self.device_reads = 0  # device->host reads of device memory by a host thread (device_read)
        self.error: BaseException | None = None  # first failure on the device thread
        # index tensors snapshotted at issue, by id: (tensor, version, snapshot); one piece's
        # indices go to every layer's launch, and an unchanged tensor needs no new copy
        self.snapshots: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.stop = False
        self.worker: threading.Thread | None = None
        if threaded:
            self.worker = threading.Thread(target=self._work, name="sim-device", daemon=True)
            self.worker.start()

    def on_device(self) -> bool:
        """This thread may run queued work: any thread, or only the device thread."""
        return self.worker is None or threading.current_thread() is self.worker

    def _work(self) -> None:
        """Threaded mode: the device runs queued work by itself, oldest first, beside
        the threads that queue it (a copy engine)."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stop or self.busy)
                if not self.busy:
                    return
                s = min(self.busy, key=lambda st: st._ops[0][0])
            try:
                s._run_to(s.done + 1)
            except BaseException as e:  # noqa: BLE001 - reported to every waiter
                with self.cond:
                    self.error = self.error or e
                    self.cond.notify_all()

    def wait_until(self, cond: Callable[[], bool]) -> None:
        with self.cond:
            self.cond.wait_for(lambda: cond() or self.error is not None)
            if self.error is not None:
                raise RuntimeError("sim-device: queued work failed") from self.error


_DEV: _Device | None = None


def _dev() -> _Device:
    if _DEV is None:
        raise RuntimeError("sglang_l3.sim.streams: the simulator is not installed")
    return _DEV


class SimStream:
    """A queue of work. `torch.cpu.Stream(priority=...)` while installed."""

    def __init__(self, priority: int = 0, *, _device: _Device | None = None, _default: bool = False, **_: Any):
        self._d = _device or _dev()
        self.default = _default
        self.priority = priority
        self._ops: deque[tuple[int, str, Callable[[], None]]] = deque()
        self.issued = 0  # ops ever queued (or run at once) on this stream
        self.done = 0  # ops completed
        self._running = False

    def __repr__(self) -> str:
        kind = "default" if self.default else f"stream@{id(self):x}"
        return f"<SimStream {kind} done={self.done}/{self.issued}>"

    # ----------------------------------------------------------- queue
    def enqueue(self, fn: Callable[[], None], what: str = "work") -> None:
        """Queue `fn` (run it at once on the default stream)."""
        d = self._d
        with d.cond:
            self.issued += 1
            if self.default:
                self.done += 1
                fn()
            else:
                d.seq += 1
                self._ops.append((d.seq, what, fn))
                idle = not d.busy
                d.busy.add(self)
                if idle:  # only an idle device thread waits for work (a launch wakes no CPU thread)
                    d.cond.notify_all()

    def pending(self) -> list[str]:
        """Labels of the queued, not yet run, work (oldest first)."""
        with self._d.lock:
            return [what for _, what, _ in self._ops]

    def _run_to(self, mark: int) -> None:
        d = self._d
        if not d.on_device():
            d.wait_until(lambda: self.done >= mark)  # threaded: the device thread runs it
            return
        # Queued mode: the caller runs the work, under the lock. Threaded: the device
        # thread runs it without the lock, so other threads keep queueing meanwhile.
        with d.lock if d.worker is None else contextlib.nullcontext():
            if self.done >= mark:
                return
            if self._running:
                raise SimDeadlock(f"{self!r} must run past its current op to reach {mark}: streams wait in a cycle")
            self._running = True
            try:
                while self.done < mark:
                    with d.lock:
                        _, _, fn = self._ops.popleft()
                    try:
                        fn()
                    finally:
                        with d.cond:
                            self.done += 1  # a failed op is not run again (a device error is sticky)
                            if not self._ops:
                                d.busy.discard(self)
                            d.cond.notify_all()
            finally:
                self._running = False

    # ---------------------------------------------- torch.cuda.Stream API
    def synchronize(self) -> None:
        self._run_to(self.issued)

    def query(self) -> bool:
        return self.done >= self.issued

    def wait_stream(self, other: SimStream) -> None:
        """Later work on this stream runs after what `other` has queued so far."""
        if other is self or not isinstance(other, SimStream):
            return
        mark = other.issued
        if self.default:
            other._run_to(mark)
        elif other.done < mark:
            self.enqueue(lambda: other._run_to(mark), "barrier")

    def wait_event(self, event: SimEvent) -> None:
        if not isinstance(event, SimEvent) or event.stream is None or event.stream is self:
            return
        s, mark = event.stream, event.mark
        if self.default:
            s._run_to(mark)
        elif s.done < mark:
            self.enqueue(lambda: s._run_to(mark), "barrier")

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else SimEvent()
        event.record(self)
        return event


class SimEvent:
    """A position in one stream's queue. `torch.cpu.Event()` while installed.

    Takes no arguments, as torch.cpu.Event does: upstream probes the device's Event
    once per process and caches the answer (sglang/srt/mem_cache/l2_transfer.py
    `_timing_events_supported`, @cache); a probe answered under the simulator must
    hold after it is uninstalled."""

    def __init__(self) -> None:
        self.stream: SimStream | None = None
        self.mark = 0

    def record(self, stream: SimStream | None = None) -> None:
        s = stream if stream is not None else current_stream()
        with s._d.lock:
            self.stream, self.mark = s, s.issued

    def done(self) -> bool:
        """Complete, without the poll's chance of completing it."""
        return self.stream is None or self.stream.done >= self.mark

    def query(self) -> bool:
        if self.done():
            return True
        assert self.stream is not None  # done() without a stream
        d = self.stream._d
        if d.worker is not None:
            return False  # threaded: the device completes it by itself
        with d.lock:
            d.polls += 1
            if not d.held and d.rng.random() < d.p_complete:
                self.stream._run_to(self.mark)
                return True
            d.lagged += 1
            return False

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream._run_to(self.mark)

    def wait(self, stream: SimStream | None = None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)

    def elapsed_time(self, end_event: SimEvent) -> float:
        return 0.0


class StreamContext:
    """`with torch.cpu.stream(s):` / `torch.cpu.StreamContext(s)` - per thread, as on a GPU."""

    def __init__(self, stream: SimStream | None) -> None:
        self.stream = stream
        self._prev: list[SimStream] = []

    def __enter__(self) -> SimStream | None:
        d = _dev()
        self._prev.append(current_stream())
        if self.stream is not None:
            d.tls.current = self.stream
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        _dev().tls.current = self._prev.pop()


def stream(s: SimStream | None) -> StreamContext:
    return StreamContext(s)


def current_stream(device: Any = None) -> SimStream:
    d = _dev()
    return getattr(d.tls, "current", d.default)


def default_stream(device: Any = None) -> SimStream:
    return _dev().default


def synchronize(device: Any = None) -> None:
    """The whole device: every stream drained."""
    d = _dev()
    if not d.on_device():
        d.wait_until(lambda: not d.busy)
        return
    with d.lock:
        while d.busy:
            next(iter(d.busy)).synchronize()


def enqueue(fn: Callable[[], None], what: str = "work") -> None:
    """Queue `fn` on this thread's current stream (at once on the default stream)."""
    current_stream().enqueue(fn, what)


def pending() -> dict[SimStream, list[str]]:
    """Every stream with queued work, and its labels."""
    d = _dev()
    with d.lock:
        return {s: s.pending() for s in list(d.busy)}


def chance() -> bool:
    """A seeded coin (the poll's completion probability): lets a harness pick one of
    the orders a real device may run its streams in."""
    d = _dev()
    with d.lock:
        return d.rng.random() < d.p_complete


def installed() -> bool:
    return _DEV is not None


def set_p_complete(p: float) -> float:
    """Set the chance that a poll completes a pending event (lower: acks lag more polls,
    as on a loaded GPU); returns the previous one."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"sim_streams: p_complete must be in (0, 1], got {p!r}")
    d = _dev()
    with d.lock:
        prev, d.p_complete = d.p_complete, p
    return prev


def hold_acks(held: bool) -> bool:
    """While held, polling a pending event never completes it (acks lag for as long as
    a test needs, e.g. an aborted stream's copies); a synchronize still runs the work,
    as a wait on a GPU does. Returns the previous setting."""
    d = _dev()
    with d.lock:
        prev, d.held = d.held, held
    return prev


def stats() -> dict[str, int]:
    d = _dev()
    return {"seed": d.seed, "polls": d.polls, "lagged": d.lagged, "device_reads": d.device_reads}


def device_read() -> None:
    """A host thread reads device memory (an index tensor's `.cpu()`): on a GPU a blocking
    copy, a sync. Counted (`stats()["device_reads"]`). Threaded mode: the caller waits until
    the device has run everything queued so far, as the blocking copy waits behind it on the
    default stream (legacy semantics; the benchmark's scheduler thread sees that wait).
    Queued mode (the tests): counted only; running the queues here would land every copy
    queued so far and hide the orderings the tests look for."""
    d = _dev()
    with d.lock:
        d.device_reads += 1
    if d.worker is not None and not d.on_device():
        d.wait_until(lambda: not d.busy)


def _is_index(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dtype != torch.bool


def _snapshot(x: torch.Tensor) -> torch.Tensor:
    """A copy of index tensor `x` as it is now; the same copy while `x` is unchanged (same
    object, same version counter: an in-place write to it takes a new copy)."""
    d = _dev()
    with d.lock:
        hit = d.snapshots.get(id(x))
        if hit is not None and hit[0] is x and hit[1] == x._version:
            return hit[2]
        if len(d.snapshots) >= 16:
            d.snapshots.clear()
        snap = x.clone()
        d.snapshots[id(x)] = (x, x._version, snap)
        return snap


def deferred(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    """Wrap a host<->device transfer: on a non-default current stream it is queued
    and touches memory when it runs, as a DMA does. Index tensors are copied at
    issue (what a kernel's record_stream keeps alive); data buffers are captured by
    reference, so a late run reads its source and writes its destination as they
    are then."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if _DEV is None:
            return fn(*args, **kwargs)
        s = current_stream()
        if s.default:
            return fn(*args, **kwargs)
        a = tuple(_snapshot(x) if _is_index(x) else x for x in args)
        k = {n: (_snapshot(v) if _is_index(v) else v) for n, v in kwargs.items()}
        s.enqueue(lambda: fn(*a, **k), what)
        return None

    return run


_SAVED: dict[str, Any] = {}
_API = {
    "Stream": SimStream,
    "Event": SimEvent,
    "StreamContext": StreamContext,
    "stream": stream,
    "current_stream": current_stream,
    "synchronize": synchronize,
}
_MISSING = object()


def install(seed: int, p_complete: float = P_COMPLETE, *, threaded: bool = False) -> None:
    """Point torch.cpu's stream API at a fresh simulated device (seeded). `threaded`: a
    device thread runs queued work by itself as soon as it can (a copy engine beside the
    scheduler: benchmark/stall_bench.py) instead of when something waits or polls."""
    global _DEV
    if _DEV is not None:
        raise RuntimeError("sglang_l3.sim.streams: already installed")
    _DEV = _Device(seed, p_complete, threaded)
    for name, obj in _API.items():
        _SAVED[name] = getattr(torch.cpu, name, _MISSING)
        setattr(torch.cpu, name, obj)
    faults.simulated_device(True)  # test faults are honoured on the simulated device


def uninstall() -> None:
    """Drain every stream (nothing is lost), then restore torch.cpu (also when draining
    fails: the failure is raised after)."""
    global _DEV
    if _DEV is None:
        return
    d = _DEV
    try:
        synchronize()
    finally:
        if d.worker is not None:
            with d.cond:
                d.stop = True
                d.busy.clear()
                d.cond.notify_all()
            d.worker.join()
        for name, obj in _SAVED.items():
            if obj is _MISSING:
                delattr(torch.cpu, name)
            else:
                setattr(torch.cpu, name, obj)
        _SAVED.clear()
        _DEV = None
        faults.simulated_device(False)
