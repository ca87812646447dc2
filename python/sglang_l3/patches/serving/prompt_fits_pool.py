"""Patch `prompt-fits-pool` (why: patches/series.toml): a prompt that no empty KV
pool could admit is refused at arrival, not queued for ever.

How: AROUND `Scheduler.init_req_max_new_tokens` (the arrival-time clip of a request
to the empty pool), after upstream's clip: the prompt that will be admitted (the
request's, or its truncation under `--allow-auto-truncate`) is compared with the
pool. What `PrefillAdder.add_one_req` charges it with no new token (the prompt, the
per-request page, a shared-pool state slot, the allocator's request reserve) must be
strictly below the pool's capacity, as `PrefillBudget.check_prefill` requires; when
it is not, the request is aborted through upstream's own path (HTTP 400 naming the
figures). A prompt upstream's length check refuses anyway keeps upstream's error,
and every other request upstream's clip. The decision reads only the request and the
configuration: every TP rank makes the same one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.scheduler:Scheduler.init_req_max_new_tokens"


def smallest_admission(allocator: Any, input_tokens: int) -> int:
    """KV tokens `PrefillAdder.add_one_req` charges a fresh request of `input_tokens`
    prompt tokens that decodes nothing: the prompt, one page of alignment overhead, one
    state slot in a shared Mamba pool (`mamba_slot_full_token_cost`, absent elsewhere)
    and the allocator's request reserve."""
    need = input_tokens + int(allocator.page_size)
    slot_cost = getattr(allocator, "mamba_slot_full_token_cost", None)
    if callable(slot_cost):
        need += int(slot_cost())
    need += int(allocator.request_slot_reserve(has_req_pool_slot=False, prefill_tokens=input_tokens))
    return need


def pool_capacity(sched: Any) -> int:
    """The empty pool's token capacity, as upstream's arrival clip computes it for the
    allocator (`token_capacity`; with sharded KV, admission's page per shard beyond the
    first is taken off)."""
    widening = int(getattr(sched, "kv_shard_widening", 1) or 1)
    return int(sched.max_total_num_tokens) * widening - int(sched.page_size) * (widening - 1)


def refusal(sched: Any, req: Any) -> str | None:
    """Why `req` can never be admitted, or None. Leaves to upstream what it refuses
    itself: an earlier abort, or a prompt its length check rejects."""
    if getattr(req, "to_finish", None) is not None:
        return None
    from sglang.srt.runtime_context import get_serving

    length = len(req.origin_input_ids)
    limit = sched.max_req_input_len
    if length >= limit:  # upstream's validate_input_length: an error, or a truncation
        if not get_serving().allow_auto_truncate:
            return None
        length = limit
    allocator = sched.token_to_kv_pool_allocator
    need, capacity = smallest_admission(allocator, length), pool_capacity(sched)
    if need < capacity:
        return None
    return (
        f"Request prompt exceeds the KV memory budget: a prompt of {length} tokens needs {need} KV "
        f"tokens to be admitted (the prompt, a page of {allocator.page_size} and the request's "
        f"reserves), the device pool holds {capacity}. Use a shorter prompt or give the pool more "
        "tokens (--max-total-tokens, --mem-fraction-static)."
    )


def _init_req_max_new_tokens(orig: Callable[..., Any], sched: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    result = orig(sched, req, *args, **kwargs)
    why = refusal(sched, req)
    if why is not None:
        logger.warning("sglang-l3 prompt-fits-pool: %s (rid %s)", why, req.rid)
        req.set_finish_with_abort(why)
        req.sampling_params.max_new_tokens = 0  # as upstream's own abort in this method
        req.sampling_params.min_new_tokens = min(req.sampling_params.min_new_tokens, 0)
    return result


def apply(ctx: PatchContext) -> None:
    ctx.around(TARGET, _init_req_max_new_tokens)
