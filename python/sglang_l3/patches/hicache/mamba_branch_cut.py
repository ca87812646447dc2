"""Patch `mamba-branch-cut` (why: patches/series.toml): a request that branches off
another context mid-node keeps the Mamba state at the end of its own prompt.

How: AROUND `PrefillAdder._select_prefill_admission`. When the admission would prefill
the rest of the prompt in one extend that contains the request's Mamba branching point
at a position upstream tracks instead of the extend's end, the extend stops at the
branching point: the request becomes the batch's chunked request, its first chunk ends
on the branch (the state there is the chunk's last state), and the next chunk tracks
the end of the prompt as any prefill does. AROUND `_commit_prefill_admission` spends the
batch's chunk budget after such a cut, so no second request is chunked in the batch
(the scheduler tracks one). The cost is one more forward for that request.

TP: the inputs (the match's branching point, the admission, the chunk budget) are the
same on every rank, so every rank cuts alike.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.mamba_branch_cut")

ADDER = "sglang.srt.managers.schedule_policy:PrefillAdder"
CUT_ATTR = "_sglang_l3_branch_cut"  # the request this adder cut, until its admission is committed


def branch_cut_len(req: Any, prefix_len: int, extend_len: int, grid: int) -> int | None:
    """The extend length that ends a whole-prompt prefill at the request's branching
    point, or None where upstream keeps the end state anyway.

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


def _grid(adder: Any) -> int:
    from sglang.srt.runtime_context import mamba_cache_chunk_size, mamba_checkpoint_grid

    # the branch is tracked on the cache chunk grid; the cut chunk's own end state lands
    # on the checkpoint grid: both hold for b - prefix on their common multiple
    return math.lcm(mamba_cache_chunk_size(), mamba_checkpoint_grid(adder.page_size))


def apply(ctx: PatchContext) -> None:
    from sglang.srt.managers.schedule_policy import AddReqResult

    def select(orig: Any, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        admission = orig(self, req, *args, **kwargs)
        if isinstance(admission, AddReqResult) or admission.is_chunked:
            return admission  # a verdict, or a chunk: the end is not this extend's
        if (
            kwargs.get("has_chunked_req")
            or self.rem_chunk_tokens is None  # chunked prefill off: no second chunk
            or self.new_chunked_req is not None
            or self.dllm_config is not None
            or not getattr(self.tree_cache, "enable_mamba_extra_buffer", False)
        ):
            return admission
        cut = branch_cut_len(req, admission.prefix_len, admission.extend_len, _grid(self))
        if cut is None:
            return admission
        setattr(self, CUT_ATTR, req)
        metrics.inc("mamba_branch_cuts")
        logger.debug(
            "sglang-l3 mamba-branch-cut: req=%s prefill %d..%d cut at the branch %d",
            req.rid,
            admission.prefix_len,
            admission.prefix_len + admission.extend_len,
            admission.prefix_len + cut,
        )
        return dataclasses.replace(admission, extend_len=cut, max_new_tokens=0, is_chunked=True)

    def commit(orig: Any, self: Any, req: Any, admission: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, req, admission, *args, **kwargs)
        if getattr(self, CUT_ATTR, None) is req:
            setattr(self, CUT_ATTR, None)
            if admission.is_chunked:
                self.rem_chunk_tokens = 0  # one chunked request per batch: admit no one else
        return out

    ctx.around(f"{ADDER}._select_prefill_admission", select)
    ctx.around(f"{ADDER}._commit_prefill_admission", commit)
