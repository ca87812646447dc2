"""The real scheduler admission path over an `L3Stack`, without a model.

A `Scheduler.__new__` object carries only the attributes that the real
methods read; the methods themselves are upstream's:
`_add_request_to_queue` → `_prefetch_kvcache` (arrival),
`_get_new_batch_prefill_raw` (admission: init_next_round_input,
prepare_staged_prefetch, `PrefillAdder.add_one_req`, `ScheduleBatch.init_new`,
`prepare_for_extend`), and the deferred Mamba CoW/clear step of
`ModelRunner` on a stub forward batch. What a model forward would compute is
replaced by writing known values into the request's KV rows and Mamba slot,
then upstream's `cache_unfinished_req` / `cache_finished_req` run as after a
real forward.
"""

from __future__ import annotations

import time
import types
from array import array
from typing import Any

import torch

from sglang_l3.testing.stack import L3Stack, RestoreFailed, on_stream, pump, wait_for_work


class _NoGrammar:
    def has_waiting_grammars(self) -> bool:
        return False


class _NoBeams:
    def pending_member_rows(self, batch: Any) -> int:
        return 0

    def retire_group(self, req: Any) -> None:
        return None


class _Ratio:
    current = 0.4


class _Inquirer:
    def _get_num_pending_tokens(self, chunk_deduct: int = 0) -> int:
        return 0


class SchedulerHarness:
    def __init__(
        self,
        stack: L3Stack,
        *,
        chunked_prefill_size: int = 8192,
        max_prefill_tokens: int = 16384,
        max_running_requests: int = 8,
        policy: str = "fcfs",
    ):
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import SchedulePolicy
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.stack = stack
        cache = stack.cache
        s = Scheduler.__new__(Scheduler)
        s.tree_cache = cache
        s.req_to_token_pool = stack.req_to_token_pool
        s.token_to_kv_pool_allocator = stack.allocator
        s.page_size = stack.spec.page_size
        s.waiting_queue = []
        s.chunked_req = None
        s.enable_hicache_storage = True
        s.enable_lmcache = False
        s.enable_hierarchical_cache = True
        s.enable_unified_cache_external_linker = False
        s.disaggregation_mode = DisaggregationMode.NULL
        s.enable_priority_scheduling = False
        s.enable_priority_preemption = False
        s.schedule_low_priority_values_first = False
        s.is_hybrid_swa = False
        s.max_queued_requests = None
        s.processed_tokens_counter = 0
        s.grammar_manager = _NoGrammar()
        s.min_free_slots_delayer = None
        s.beam_coordinator = _NoBeams()
        s.policy = SchedulePolicy(policy, cache, True, False, False)
        s.chunked_prefill_size = chunked_prefill_size
        s.dynamic_chunk_sizer = None
        s.tp_worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(attn_backend=object(), prefill_aware_swa=False)
        )
        s.new_token_ratio_tracker = _Ratio()
        s.max_prefill_tokens = max_prefill_tokens
        s.is_mixed_chunk = False
        s.priority_scheduling_preemption_threshold = 10
        s.max_prefill_bs = max_running_requests
        s.max_running_requests = max_running_requests
        s.dllm_config = None
        s.enable_lora = False
        s.truncation_align_size = None
        s.model_config = types.SimpleNamespace(vocab_size=32000, is_encoder_decoder=False)
        s.enable_overlap = False
        s.spec_algorithm = SpeculativeAlgorithm.NONE
        s.hisparse_coordinator = None
        s.load_inquirer = _Inquirer()
        s.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.s = s
        self._rid = 0
        from sglang.srt.runtime_context import get_parallel

        stack._exit.enter_context(get_parallel().override(pp_max_micro_batch_size=max_running_requests))

    # ---------------------------------------------------------------- requests
    def make_req(self, input_ids: list[int], rid: str | None = None, max_new_tokens: int = 1) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._rid += 1
        sp = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
        sp.normalize(None)
        return Req(
            rid=rid or f"h{self._rid}",
            origin_input_text="",
            origin_input_ids=array("q", input_ids),
            sampling_params=sp,
        )

    def arrive(self, req: Any) -> None:
        """A request enters the waiting queue (real _add_request_to_queue)."""
        self.s._add_request_to_queue(req)

    def pump(self, cond: Any = None, what: str = "hicache events", timeout: float = 120.0) -> None:
        pump(self.stack.cache, cond or (lambda: True), what, timeout)

    def wait_prefetch(self, req: Any, timeout: float = 120.0, *, reissue: bool = False) -> None:
        """Poll the request's prefetch until it is done. With `reissue`, each step is the
        scheduler's own `_process_hicache_events` (the HiCache drain, then the due L3
        re-issues of `_process_storage_prefetch_retries`) instead of the drain alone."""
        cache = self.stack.cache
        handle = req.cache_request_handle
        deadline = time.monotonic() + timeout
        while True:
            if reissue:
                self.s._process_hicache_events()
            else:
                cache.check_hicache_events()
            if cache.check_prefetch_progress(handle):
                return
            if time.monotonic() > deadline:
                raise RestoreFailed(f"timed out waiting for: prefetch of {req.rid}")
            wait_for_work(cache)

    def admit(self) -> Any:
        """One real admission pass; returns the new ScheduleBatch (or None)."""
        batch, self.s.running_batch = self.s._get_new_batch_prefill_raw(None, self.s.running_batch)
        return batch

    # ------------------------------------------------------------------ forward
    def run_deferred_mamba_cow_and_clear(self, batch: Any) -> None:
        """The ModelRunner step that executes the batch's deferred CoW/clear."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.model_runner import ModelRunner

        mr = ModelRunner.__new__(ModelRunner)
        mr.req_to_token_pool = self.stack.req_to_token_pool
        mr.is_draft_worker = False
        fb = types.SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            mamba_cow_src_indices=getattr(batch, "mamba_cow_src_indices", None),
            mamba_cow_dst_indices=getattr(batch, "mamba_cow_dst_indices", None),
            mamba_clear_indices=getattr(batch, "mamba_clear_indices", None),
        )
        mr._maybe_execute_deferred_mamba_cow_and_clear(fb)

    def forward(self, batch: Any) -> None:
        """Stand in for a model forward, on the stack's forward stream as the scheduler
        runs it: the batch's hicache consumer is set and every layer waits on upstream's
        per-layer load events (no ack is awaited first); the prefix rows (and the CoW
        source states) are read behind those waits, then the deferred CoW/clear runs and
        each request's new KV rows are written. The forward stream is then drained (the
        result is read back), the reads checked against what fill_kv wrote, the load-back
        ack reaped and the read Mamba states checked against what landed."""
        st = self.stack
        cache = st.cache
        if batch is None:
            pump(cache, lambda: not cache.buffer_pipeline.ongoing_buffer_load_back, "load-back ack")
            return
        rtt = st.req_to_token_pool.req_to_token
        rows = torch.cat([rtt[r.kv.req_pool_idx, : r.prefix_len].long() for r in batch.reqs])
        ids = torch.cat([torch.tensor(list(r.full_untruncated_fill_ids[: r.prefix_len])) for r in batch.reqs])
        pos = torch.cat([torch.arange(r.prefix_len) for r in batch.reqs])
        src = getattr(batch, "mamba_cow_src_indices", None)
        slots = [] if src is None else [int(x) for x in torch.as_tensor(src).reshape(-1).tolist()]
        read = st.forward_read(
            batch.hicache_consumer_index, rows, ids.long() if st.check_forward_kv else None, pos, slots
        )

        def compute() -> None:
            self.run_deferred_mamba_cow_and_clear(batch)
            for req in batch.reqs:
                start, end = req.prefix_len, req.extend_end
                if end > start:
                    new_rows = rtt[req.kv.req_pool_idx, start:end].long()
                    st.fill_kv(new_rows, list(req.full_untruncated_fill_ids[start:end]), start)

        with st.device_module.stream(st.forward_stream):
            on_stream(compute, "forward")
        st.finish_forward()
        st.check_forward_read(read)
        pump(cache, lambda: not cache.buffer_pipeline.ongoing_buffer_load_back, "load-back ack")
        st.check_forward_mamba(read)
        chunked = self.s.chunked_req
        if chunked is not None and chunked.inflight_middle_chunks > 0:
            chunked.inflight_middle_chunks -= 1  # the result of this chunk is in

    def serve(self, req: Any) -> None:
        """One request, alone: arrival → admission → every chunk → finish."""
        self.arrive(req)
        self.wait_prefetch(req)
        self.forward(self.admit())
        while self.s.chunked_req is not None:
            self.stash_chunk()
            self.forward(self.admit())
        self.finish(req)

    def stash_chunk(self) -> None:
        """What the next scheduling step does with a chunked request first."""
        req = self.s.chunked_req
        if req is not None and req.extend_end > req.prefix_len:
            self.s.stash_chunked_request(req)

    def mamba_state(self, slot: int) -> list[torch.Tensor]:
        mc = self.stack.mamba_cache
        s = torch.tensor([int(slot)])
        return [mc.temporal[:, s].clone()] + [c[:, s].clone() for c in mc.conv]

    def finish(self, req: Any, output_token: int = 7) -> None:
        """Prefill done, one token sampled, request finished: upstream's
        release_kv_cache(checkpoint=True) donates state, unlocks, frees the row."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        req.output_ids.append(output_token)
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.stack.cache, checkpoint=True)

    def abort_queued(self, req: Any) -> None:
        """Abort a request still in the waiting queue (scheduler.py abort path)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.common import release_kv_cache

        self.s.waiting_queue.remove(req)
        self.s._release_aborted_request(req)
        if req.kv.holds_mamba:
            req.finished_reason = FINISH_ABORT()
            release_kv_cache(req, self.stack.cache, checkpoint=False)

    def abort_running(self, req: Any) -> None:
        """Abort an admitted request after its prefill (its KV is never kept)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
        from sglang.srt.mem_cache.common import release_kv_cache

        req.finished_reason = FINISH_ABORT()
        self.stack.cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
        release_kv_cache(req, self.stack.cache, checkpoint=False)
