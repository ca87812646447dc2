"""Randomized soak of buffer-only hybrid L3 restores through the real scheduler path.

Agents share a system prompt and grow their own histories; requests arrive in
bursts, the device is forced to evict between steps, waiting and running
requests are aborted, and storage reads fail in injected windows. After every
admission the re-anchor invariants are checked on each restored request, KV of
every admitted prefix is compared with what was written, and with
SGLANG_L3_VERIFY=1 the Mamba states are compared at every ack. At quiet points
and at the end every pool must be back to its baseline.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_l3 import metrics
from sglang_l3.patches.hicache.reanchor import ReanchorViolation, record_of
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack


@dataclass
class SoakReport:
    requests: int = 0
    admitted: int = 0
    restores: int = 0
    restored_tokens: int = 0
    aborts: int = 0
    fault_windows: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    leaked: dict[str, int] = field(default_factory=dict)
    baseline_checks: int = 0

    def lines(self) -> list[str]:
        fb = ", ".join(f"{k}={v}" for k, v in sorted(self.fallbacks.items())) or "none"
        return [
            f"requests={self.requests} admitted={self.admitted} aborts={self.aborts}",
            f"restores={self.restores} restored_tokens={self.restored_tokens} fault_windows={self.fault_windows}",
            f"recompute_fallbacks: {fb}",
            f"violations={len(self.violations)} leaked_slots={sum(abs(v) for v in self.leaked.values())} "
            f"baseline_checks={self.baseline_checks}",
        ]


OUTPUT_TOKEN = 7


class _FlakyStorage:
    """Wraps the controller's backend: while `failing`, every read fails."""

    def __init__(self, backend: Any):
        self._backend = backend
        self.failing = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        if self.failing:
            return {t.name: [False] * len(t.keys or []) for t in transfers}
        return self._backend.batch_get_v2(transfers, extra_info)


def _holders(st: L3Stack) -> str:
    """Who still holds staging memory (for a violation message)."""
    bp = st.cache.buffer_pipeline
    cache = st.cache
    return (
        f"staged={[r.rid for r in bp.staged_prefetches]} "
        f"ongoing_prefetch={[r.rid for r in getattr(cache, 'ongoing_prefetch', {})]} "
        f"load_backs={len(bp.ongoing_buffer_load_back)} anchor_locks={len(bp.anchor_locks)} "
        f"pending_writes={len(bp.pending_write_queue)} inflight_backups={len(bp.inflight_backup_node_ids)} "
        f"occupied={st.cache.cache_controller.prefetch_tokens_occupied}"
    )


def _check_restored(st: L3Stack, req: Any, report: SoakReport) -> None:
    rec = record_of(req)
    if rec is None or getattr(req, "_soak_checked", False):
        return
    req._soak_checked = True
    report.restores += 1
    report.restored_tokens += rec.loaded
    problems = []
    if req.last_node != rec.node:
        problems.append("last_node")
    if req.lock is None or req.lock.node != rec.node:
        problems.append("lock")
    if req.prefix_len != int(st.cache.path_device_indices(rec.node).numel()):
        problems.append("prefix_len")
    if rec.req_slot is None or rec.req_slot == rec.node_slot:
        problems.append("slots")
    if problems:
        report.violations.append(f"{req.rid}: {','.join(problems)}")


def _check_kv(st: L3Stack, req: Any, report: SoakReport) -> None:
    n = req.prefix_len
    if n == 0:
        return
    rows = st.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
    layer = st.kv_pool.start_layer
    k = st.kv_pool.get_key_buffer(layer)[rows]
    v = st.kv_pool.get_value_buffer(layer)[rows]
    ek, ev = st.expected_kv(list(req.full_untruncated_fill_ids[:n]))
    if not (torch.equal(k, ek) and torch.equal(v, ev)):
        report.violations.append(f"{req.rid}: KV of its {n}-token prefix differs")


def run_soak(
    n_requests: int,
    store_dir: str,
    *,
    seed: int = 0,
    # page 1 (no_buffer Mamba): a finished request donates its own state, so
    # multi-turn histories reach L3 without a model. With page > 1 the
    # extra_buffer strategy checkpoints only states the model tracked.
    page_size: int = 1,
    agents: int = 6,
    tree_core: str = "rust",
    progress: Any | None = None,
    abort_queued_p: float = 0.05,
    abort_running_p: float = 0.05,
    fault_p: float = 0.03,
) -> SoakReport:
    rng = random.Random(seed)
    report = SoakReport()
    fb0 = {k: v for k, v in metrics.snapshot().items() if k.startswith("recompute_fallbacks")}
    spec = HybridSpec(page_size=page_size, kv_size=4096, max_context_len=4096, mamba_cache_size=64, max_num_reqs=16)
    with L3Stack(spec, store_dir, tree_core=tree_core) as st:
        cc = st.cache.cache_controller
        flaky = _FlakyStorage(cc.storage_backend)
        cc.storage_backend = flaky
        h = SchedulerHarness(st, chunked_prefill_size=rng.choice([64, 128, 256]), max_running_requests=6)
        system = [rng.randrange(1, 30000) for _ in range(16 * page_size)]
        histories = [list(system) for _ in range(agents)]
        running: list[Any] = []
        fault_left = 0
        issued = 0
        step = 0
        draining = False
        while issued < n_requests or h.s.waiting_queue or running or h.s.chunked_req is not None:
            step += 1
            # Arrivals: a burst of turns from random agents (sometimes a branch).
            if step % 40 == 0:
                draining = True  # a quiet point: let everything drain, then check pools
            for _ in range(rng.randint(0, 3) if issued < n_requests and not draining else 0):
                a = rng.randrange(agents)
                hist = histories[a]
                if rng.random() < 0.15 and len(hist) > 2 * page_size:
                    hist = hist[: rng.randrange(page_size, len(hist))]  # branch off an earlier point
                turn = [rng.randrange(1, 30000) for _ in range(rng.randint(1, 24) * page_size // 2 + 1)]
                prompt = hist + turn
                if len(prompt) > 1500:
                    prompt = system + turn
                histories[a] = prompt + [OUTPUT_TOKEN]  # the next turn carries this answer
                req = h.make_req(prompt, rid=f"s{issued}")
                h.arrive(req)
                issued += 1
                report.requests += 1
            # Faults: a window of failing storage reads.
            if fault_left == 0 and rng.random() < fault_p:
                fault_left = rng.randint(1, 5)
                report.fault_windows += 1
            flaky.failing = fault_left > 0
            fault_left = max(0, fault_left - 1)
            # Memory pressure.
            r = rng.random()
            if r < 0.25:
                st.evict_all()
            elif r < 0.5:
                from sglang.srt.mem_cache.base_prefix_cache import EvictParams

                st.cache.evict(EvictParams(num_tokens=rng.randint(1, 512), mamba_num=rng.randint(0, 8)))
            # Aborts of queued requests.
            if h.s.waiting_queue and rng.random() < abort_queued_p:
                victim = rng.choice(h.s.waiting_queue)
                if victim is not h.s.chunked_req:
                    h.abort_queued(victim)
                    report.aborts += 1
            st.cache.check_hicache_events()
            if h.s.chunked_req is not None:
                h.stash_chunk()
            try:
                batch = h.admit()
            except ReanchorViolation as e:
                report.violations.append(str(e))
                break
            if batch is not None:
                h.forward(batch)
                for req in batch.reqs:
                    _check_restored(st, req, report)
                    _check_kv(st, req, report)
                    if req is h.s.chunked_req:
                        continue
                    report.admitted += 1
                    if rng.random() < abort_running_p:
                        h.abort_running(req)
                        report.aborts += 1
                    else:
                        h.finish(req, output_token=OUTPUT_TOKEN)
            if progress is not None and step % 50 == 0:
                progress(report, step)
            # Quiet point: everything drained → pools must be at baseline.
            if draining and not h.s.waiting_queue and h.s.chunked_req is None:
                draining = False
                st.settle()
                st.evict_all()
                diff = {k: st.baseline[k] - v for k, v in st.pool_sizes().items() if st.baseline[k] != v}
                report.baseline_checks += 1
                if diff:
                    report.violations.append(f"pools off baseline at step {step}: {diff}; {_holders(st)}")
                    break
        flaky.failing = False
        st.settle()
        st.evict_all()
        report.leaked = {k: st.baseline[k] - v for k, v in st.pool_sizes().items() if st.baseline[k] != v}
        cc.storage_backend = flaky._backend
    fb1 = {k: v for k, v in metrics.snapshot().items() if k.startswith("recompute_fallbacks")}
    report.fallbacks = {k.split("{", 1)[1].rstrip("}"): fb1[k] - fb0.get(k, 0) for k in fb1 if fb1[k] - fb0.get(k, 0)}
    return report
