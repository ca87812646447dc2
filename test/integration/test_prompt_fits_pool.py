"""Patch `prompt-fits-pool` on the real scheduler path (`SchedulerHarness`: upstream's
`Scheduler.init_req_max_new_tokens`, `_add_request_to_queue`, `PrefillAdder`): every
prompt is either refused at arrival or admitted by an empty pool, at the lengths around
admission's boundary (a page below it, either side of it, the pool's last two tokens),
page 1 and page 64. Without the patch
the prompts within a page of the pool are neither: admission answers "no room" with
nothing running and nothing to evict, pass after pass (a server spins on them for ever
and every request behind them waits; upstream #28530). On a server upstream's input-length
check (`max_req_input_len`, the pool less 6) already refuses the last five lengths; at
page 64 the 59 below them are the ones that hung."""

from __future__ import annotations

import pytest
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack

POOL = 384


def _arrival(h: SchedulerHarness, n: int, base: int) -> object:
    """A fresh request of `n` prompt tokens through upstream's arrival clip."""
    s = h.s
    s.max_new_tokens_limit = None
    s.max_total_num_tokens = POOL
    s.max_req_len = POOL - 1  # tp_worker: min(context_len - 1, kv_capacity - 1)
    s.kv_shard_widening = 1
    s.sliding_window_size = None
    req = h.make_req(list(range(base, base + n)), max_new_tokens=16)
    s.init_req_max_new_tokens(req)
    return req


def _refused(req: object) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(getattr(req, "to_finish", None), FINISH_ABORT)


def _admitted_alone(h: SchedulerHarness, req: object) -> bool:
    """Whether an empty pool admits `req`; either way the pool is empty again after."""
    h.arrive(req)
    h.wait_prefetch(req)
    for _ in range(3):  # nothing runs and nothing is held: another pass changes nothing
        batch = h.admit()
        if batch is not None:
            assert [r.rid for r in batch.reqs] == [req.rid]
            assert h.s.chunked_req is None  # one chunk: the harness's chunk is 8192
            h.forward(batch)
            h.abort_running(req)
            return True
    h.abort_queued(req)
    return False


def _lengths(page: int) -> list[int]:
    edge = POOL - page  # the first length upstream neither refuses nor admits
    return sorted({edge - page - 1, edge - 2, edge - 1, edge, edge + 1, POOL - 2, POOL - 1} & set(range(1, POOL)))


@pytest.mark.parametrize("page", [1, 64])
def test_a_prompt_is_refused_at_arrival_or_admitted_by_an_empty_pool(tmp_path, page):
    with L3Stack(HybridSpec(page_size=page, kv_size=POOL), str(tmp_path)) as st:
        h = SchedulerHarness(st)
        free = st.allocator.available_size()
        assert free == POOL
        verdicts = {}
        for i, n in enumerate(_lengths(page)):
            req = _arrival(h, n, base=1 + i * POOL)
            if _refused(req):
                verdicts[n] = "refused"
                assert "exceeds the KV memory budget" in req.to_finish.message
            else:
                verdicts[n] = "admitted" if _admitted_alone(h, req) else "stuck"
            assert st.allocator.available_size() + st.cache.evictable_size() == free, n
        edge = POOL - page
        assert "stuck" not in verdicts.values(), verdicts
        # the boundary is admission's own (prompt + a page strictly below the pool)
        assert all(v == ("admitted" if n < edge else "refused") for n, v in verdicts.items()), verdicts


@pytest.mark.parametrize("without", ["prompt-fits-pool"], indirect=True)
def test_without_the_patch_a_prompt_within_a_page_of_the_pool_is_stuck(tmp_path, without):
    page = 64
    with L3Stack(HybridSpec(page_size=page, kv_size=POOL), str(tmp_path)) as st:
        h = SchedulerHarness(st)
        req = _arrival(h, POOL - page, base=1)
        assert not _refused(req)
        assert not _admitted_alone(h, req)
