"""Patch `prompt-fits-pool` on the real scheduler path (`SchedulerHarness`: upstream's
arrival as `Scheduler.handle_generate_request` runs it, `_add_request_to_queue`,
`PrefillAdder`): every prompt is either refused at arrival or admitted by an empty pool,
at the lengths around admission's boundary (a page below it, either side of it, the
pool's last two tokens), page 1 and page 64. Upstream's input-length check
(`max_req_input_len`, the pool less 6) refuses the last six lengths itself, with its own
message. Without the patch, at page 64, the 58 lengths below those are neither refused
nor admitted: admission answers "no room" with nothing running and nothing to evict,
pass after pass (a server spins on them for ever and every request behind them waits;
upstream #28530)."""

from __future__ import annotations

import pytest
from sglang_l3.testing.scheduler_harness import SchedulerHarness
from sglang_l3.testing.stack import HybridSpec, L3Stack

POOL = 384


def _arrival(h: SchedulerHarness, n: int, base: int, truncate: bool = False) -> object:
    """A fresh request of `n` prompt tokens through upstream's arrival, as
    `Scheduler.handle_generate_request` runs it: the clip to the empty pool, then the
    input-length check (an abort, or a truncation with --allow-auto-truncate)."""
    from sglang.srt.managers.utils import validate_input_length
    from sglang.srt.runtime_context import get_context

    s = h.s
    s.max_new_tokens_limit = None
    s.max_total_num_tokens = POOL
    s.max_req_len = POOL - 1  # tp_worker: min(context_len - 1, kv_capacity - 1)
    s.max_req_input_len = s.max_req_len - 5
    s.kv_shard_widening = 1
    s.sliding_window_size = None
    req = h.make_req(list(range(base, base + n)), max_new_tokens=16)
    with get_context().override_server_args(allow_auto_truncate=truncate):
        s.init_req_max_new_tokens(req)
        error = validate_input_length(req, s.max_req_input_len, truncate)
    if error:
        req.set_finish_with_abort(error)
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
    edge = POOL - page  # the first length admission cannot take (prompt + a page = the pool)
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
                # upstream's own length check keeps its message; the rest is ours, with figures
                own = n < POOL - 6
                want = f"a prompt of {n} tokens needs" if own else "exceeds the maximum allowed length"
                assert want in req.to_finish.message, (n, req.to_finish.message)
            else:
                verdicts[n] = "admitted" if _admitted_alone(h, req) else "stuck"
            assert st.allocator.available_size() + st.cache.evictable_size() == free, n
        edge = POOL - page
        assert "stuck" not in verdicts.values(), verdicts
        # the boundary is admission's own (prompt + a page strictly below the pool), or upstream's
        # input-length check where that comes first (page 1)
        bound = min(edge, POOL - 6)
        assert all(v == ("admitted" if n < bound else "refused") for n, v in verdicts.items()), verdicts


def test_with_auto_truncate_a_prompt_longer_than_the_pool_is_refused_not_truncated(tmp_path):
    """--allow-auto-truncate cuts a long prompt to `max_req_input_len` (the pool less 6),
    after 0.5.23 clipped its new tokens to 0 from the uncut length: at page 64 the cut
    prompt is never admitted either. It is refused with the cut length's figures."""
    with L3Stack(HybridSpec(page_size=64, kv_size=POOL), str(tmp_path)) as st:
        h = SchedulerHarness(st)
        req = _arrival(h, POOL + 100, base=1, truncate=True)
        assert _refused(req)
        assert f"a prompt of {POOL - 6} tokens needs {POOL - 6 + 64} KV tokens" in req.to_finish.message


@pytest.mark.parametrize("without", ["prompt-fits-pool"], indirect=True)
def test_without_the_patch_a_prompt_within_a_page_of_the_pool_is_stuck(tmp_path, without):
    page = 64
    with L3Stack(HybridSpec(page_size=page, kv_size=POOL), str(tmp_path)) as st:
        h = SchedulerHarness(st)
        req = _arrival(h, POOL - page, base=1)
        assert not _refused(req)
        assert not _admitted_alone(h, req)
