"""Patch `prompt-fits-pool` (why: patches/series.toml): a prompt that no empty KV
pool could admit is refused at arrival, not queued forever.

How: AROUND `BaseTokenToKVPoolAllocator.max_new_tokens_for_memory` (the scheduler's
arrival-time clip, whose None upstream turns into an abort: "Request prompt exceeds
the KV memory budget") the prompt's smallest admission is compared with the pool:
what `PrefillAdder.add_one_req` charges with no new token (the prompt, the per-request
page, a shared-pool state slot, the allocator's request reserve) must be strictly
below the capacity, as `PrefillBudget.check_prefill` requires. When it is not, the
answer is None. Everything else is upstream's answer, so a prompt that fits with
fewer new tokens than asked keeps upstream's clip. The decision reads only the
request and the configuration: every TP rank makes the same one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator.max_new_tokens_for_memory"


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


def _max_new_tokens_for_memory(
    orig: Callable[..., int | None], allocator: Any, input_tokens: int, max_new_tokens: int, **kwargs: Any
) -> int | None:
    answer = orig(allocator, input_tokens, max_new_tokens, **kwargs)
    if answer is None:
        return None
    capacity = int(kwargs["token_capacity"])
    need = smallest_admission(allocator, input_tokens)
    if need >= capacity:
        logger.warning(
            "sglang-l3 prompt-fits-pool: a prompt of %d tokens needs %d KV tokens to be "
            "admitted (the prompt, a page of %d and the request's reserves), the empty "
            "pool holds %d: refused. Shorten the prompt or give the pool more tokens "
            "(--max-total-tokens, --mem-fraction-static).",
            input_tokens,
            need,
            allocator.page_size,
            capacity,
        )
        return None
    return answer


def apply(ctx: PatchContext) -> None:
    ctx.around(TARGET, _max_new_tokens_for_memory)
