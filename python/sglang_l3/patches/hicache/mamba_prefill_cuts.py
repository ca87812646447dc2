"""Patch `mamba-prefill-cuts` (why: patches/series.toml): a hybrid prefill leaves the
Mamba state its request's next call can resume from.

A request resumes only at a saved Mamba state, and a prefill saves one state per extend
(at its end, on the Mamba grid). Two ends are not where the next call needs them:
- **branch**: when the request's match found KV past its deepest state, upstream tracks
  the state at that branching point *instead of* at the extend's end, and a finished
  request caches KV only up to its last state; the request's own prompt past the branch
  is lost (two agents with one system prompt: the second agent's first call);
- **tail**: a prompt ending exactly on the grid saves its state at its last token, but a
  chat template's next call shares all but that token (Hermes on Qwen3.5: 190 of 190
  consecutive calls); the next call resumes at the previous state, a whole turn back.

How: AROUND `PrefillAdder._select_prefill_admission` (a new request's extend) and
`PrefillAdder.add_chunked_req` (a chunked request's next chunk), the extend that would
finish the prompt stops at the branching point, or one grid step before a prompt end on
the grid. The request goes on as a chunked request; the chunk's own end state is saved by
the chunk's checkpoint, and the last chunk saves the prompt's end as any prefill does.
After a cut the batch's chunk budget is spent (the scheduler tracks one chunked request).
Cost: one more forward for that request.

TP: the inputs (the match's branching point, the lengths, the budget) are the same on
every rank, so every rank cuts alike.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.mamba_prefill_cuts")

ADDER = "sglang.srt.managers.schedule_policy:PrefillAdder"
CUT_ATTR = "_sglang_l3_prefill_cut"  # the request this adder cut, until its admission is committed


def branch_cut_len(req: Any, prefix_len: int, extend_len: int, grid: int) -> int | None:
    """The extend length that ends a prefill at the request's branching point, or None
    where upstream keeps the end state anyway.

    Upstream tracks the branching point b instead of the extend's end when
    prefix < b < end and b - prefix is on the Mamba cache grid
    (`ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`). Cut only where the
    remainder [b, end) still leaves a state of its own (at least one grid step)."""
    b = getattr(req, "mamba_branching_seqlen", None)
    if b is None or grid <= 0:
        return None
    end = prefix_len + extend_len
    if not prefix_len < b < end or (b - prefix_len) % grid or end - b < grid:
        return None
    return b - prefix_len


def tail_cut_len(prompt_len: int, prefix_len: int, extend_len: int, grid: int) -> int | None:
    """The extend length that ends a prefill one grid step before the prompt's end, when
    this extend finishes a prompt whose end lies on the grid and more than one step away
    (else the state one step back is the prefix's own, or there is no such end); None
    otherwise."""
    if grid <= 0 or prefix_len + extend_len != prompt_len or prompt_len % grid or prefix_len % grid:
        return None
    if extend_len <= grid:
        return None
    return extend_len - grid


def cut_len(req: Any, prefix_len: int, extend_len: int, grid: int) -> tuple[int, str] | None:
    """(extend length, why) of the cut for an extend that finishes the request's prompt."""
    cut = branch_cut_len(req, prefix_len, extend_len, grid)
    if cut is not None:
        return cut, "branch"
    cut = tail_cut_len(len(req.full_untruncated_fill_ids), prefix_len, extend_len, grid)
    if cut is not None:
        return cut, "tail"
    return None


def mamba_grid(page_size: int) -> int:
    """The grid both cut chunks' end states land on: upstream's checkpoint grid, the
    common multiple of the cache chunk grid (where it tracks a branch) and the page."""
    from sglang.srt.runtime_context import mamba_checkpoint_grid

    return mamba_checkpoint_grid(page_size)


def _applies(adder: Any) -> bool:
    return (
        adder.rem_chunk_tokens is not None  # chunked prefill off: no second chunk
        and adder.dllm_config is None
        and bool(getattr(adder.tree_cache, "enable_mamba_extra_buffer", False))
    )


def _count(req: Any, why: str, start: int, stop: int, cut: int) -> None:
    metrics.inc("mamba_prefill_cuts", why)
    logger.debug("sglang-l3 mamba-prefill-cuts: req=%s prefill %d..%d cut at %d (%s)", req.rid, start, stop, cut, why)


def apply(ctx: PatchContext) -> None:
    from sglang.srt.managers.schedule_policy import AddReqResult

    def select(orig: Any, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        admission = orig(self, req, *args, **kwargs)
        if isinstance(admission, AddReqResult) or admission.is_chunked:
            return admission  # a verdict, or a chunk: this extend does not finish the prompt
        if kwargs.get("has_chunked_req") or self.new_chunked_req is not None or not _applies(self):
            return admission
        found = cut_len(req, admission.prefix_len, admission.extend_len, mamba_grid(self.page_size))
        if found is None:
            return admission
        cut, why = found
        setattr(self, CUT_ATTR, req)
        start = admission.prefix_len
        _count(req, why, start, start + admission.extend_len, start + cut)
        return dataclasses.replace(admission, extend_len=cut, max_new_tokens=0, is_chunked=True)

    def commit(orig: Any, self: Any, req: Any, admission: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, req, admission, *args, **kwargs)
        if getattr(self, CUT_ATTR, None) is req:
            setattr(self, CUT_ATTR, None)
            if admission.is_chunked:
                self.rem_chunk_tokens = 0  # one chunked request per batch: admit no one else
        return out

    def chunked(orig: Any, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        if not _applies(self):
            return orig(self, req, *args, **kwargs)
        prefix, remaining = req.prefix_len, len(req.full_untruncated_fill_ids) - req.prefix_len
        grid = mamba_grid(self.page_size)
        cut = tail_cut_len(prefix + remaining, prefix, remaining, grid)
        if cut is None:
            return orig(self, req, *args, **kwargs)
        old = self.chunked_req_limit
        self.chunked_req_limit = cut if old is None else min(old, cut)
        try:
            out = orig(self, req, *args, **kwargs)
        finally:
            self.chunked_req_limit = old
        if out is req and req in self.can_run_list:
            # still chunked, maybe with budget left (the limit cut it): admit no one else
            self.rem_chunk_tokens = 0
            if req.extend_end == prefix + cut:
                _count(req, "tail", prefix, prefix + remaining, prefix + cut)
        return out

    ctx.around(f"{ADDER}._select_prefill_admission", select)
    ctx.around(f"{ADDER}._commit_prefill_admission", commit)
    ctx.around(f"{ADDER}.add_chunked_req", chunked)
