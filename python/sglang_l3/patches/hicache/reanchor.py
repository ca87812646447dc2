"""Patch `reanchor` (why: patches/series.toml): an explicit, checked re-anchor
step for buffer-only L3 restores.

How: AROUND `BufferModePipeline.init_load_back`:
- before any H2D copy is queued it checks the staged plan against the request
  (prefix length, the anchor's device path); on failure it releases the staged
  hold, clears the storage-hit fields and returns None → the request is
  recomputed (counted by reason and logged with request, nodes, slots);
- after upstream returns `(n, N)` (copy queued) it binds `req.last_node = N`
  at once and checks: N's device path length = prefix + n; N has a Mamba
  device value; the request's own slot `req.kv.mamba_pool_idx` differs from N's
  and receives the same host staging slot's state; no CoW source or clear is
  pending; the prefetch anchor pin was released exactly once. A violation here
  is a fail-stop (the copy is already in flight).
- after `_commit_prefill_admission` it checks the admission lock is on N and
  `req.prefix_len` equals N's device path length.
- with SGLANG_L3_VERIFY=1 the request's slot, N's slot and the host staging
  slot are compared tensor by tensor (forces a device sync) before the
  request's first forward: at the load-back ack, or earlier, right after the
  scheduler chose the batch (patch tp-verify-restores; at TP >= 2 the ack is
  MIN-drained across ranks and may come after that forward).

Every decision reads only tree metadata and request fields that are identical
on every TP rank (the staged plan is built from the MIN-reduced hit count).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.reanchor")

PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"
ADDER = "sglang.srt.managers.schedule_policy:PrefillAdder"

_RECORD_ATTR = "_sglang_l3_restore"


class ReanchorViolation(RuntimeError):
    """A restore whose copy is already queued broke an invariant: fail-stop."""


@dataclass
class RestoreRecord:
    rid: str
    anchor_before: Any
    node: Any
    loaded: int
    prefix_after: int
    node_slot: int | None
    req_slot: int | None
    host_slot: int | None
    node_copy_slot: int | None
    load_back_id: int
    committed: bool = False
    anchor_releases: int = 0
    verified: bool = False  # SGLANG_L3_VERIFY compared the states before the first forward


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    by_request: dict[Any, RestoreRecord] = field(default_factory=dict)
    releases: dict[Any, int] = field(default_factory=dict)


_STATE = _State()


def verify_enabled() -> bool:
    return os.environ.get("SGLANG_L3_VERIFY", "0").lower() in ("1", "true", "yes")


def record_of(req: Any) -> RestoreRecord | None:
    return getattr(req, _RECORD_ATTR, None)


def _slot(t: Any) -> int | None:
    if t is None:
        return None
    return int(torch.as_tensor(t).reshape(-1)[0])


def _path_len(cache: Any, node: Any) -> int:
    return int(cache.path_device_indices(node).numel())


def _node_mamba_slot(cache: Any, node: Any) -> int | None:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    try:
        value = cache.tree_core.get_component_device_value(node, ComponentType.MAMBA)
    except Exception:
        return None
    return _slot(value)


def _describe(req: Any, **extra: Any) -> str:
    kv = req.kv
    parts = [
        f"req={req.rid}",
        f"last_node={req.last_node}",
        f"prefix_len={req.prefix_len}",
        f"req_slot={_slot(kv.mamba_pool_idx)}",
    ]
    parts += [f"{k}={v}" for k, v in extra.items()]
    return " ".join(parts)


# --------------------------------------------------------------------------- #
# Before the copy: checks that can still fall back to recompute
# --------------------------------------------------------------------------- #
def _precheck(pipe: Any, req: Any, f: Any) -> str | None:
    cache = pipe._cache
    plan = req.staged_prefetch_plan
    if f is None:
        # prepare_staged_prefetch moved the anchor for a hold that is gone:
        # returning (0, last_node) now would desynchronise the prefix and CoW.
        return "staged_hold_lost" if plan is not None else None
    if plan is None:
        return "plan_missing"
    if plan.operation_id != f.operation_id:
        return "plan_stale"
    if req.prefix_len != plan.device_prefix_len:
        return "prefix_mismatch"
    # The anchor may end past the prefix (match_full_device_prefix stops inside
    # a node without splitting it; upstream's prefix_device_indices truncates),
    # but it must cover it.
    if _path_len(cache, req.last_node) < req.prefix_len:
        return "anchor_path_short"
    return None


def fallback(pipe: Any, req: Any, reason: str) -> None:
    request = req.cache_request_handle
    pipe.release_staged_hold(request, reason=f"l3_reanchor_{reason}")
    req.staged_prefetch_plan = None
    req.host_hit_length = 0
    req.swa_host_hit_length = 0
    req.mamba_host_hit_length = 0
    pipe._clear_storage_hit(req)
    metrics.inc("recompute_fallbacks", reason)
    logger.warning("sglang-l3 reanchor: L3 restore falls back to recompute (%s): %s", reason, _describe(req))


# --------------------------------------------------------------------------- #
# After the copy is queued: bind, then check; violations fail-stop
# --------------------------------------------------------------------------- #
def _mamba_context(state: Any) -> Any:
    from sglang.srt.mem_cache.unified_cache.components.mamba import _MambaBufferLoadBackContext

    return next((c for c in state.load_contexts if isinstance(c, _MambaBufferLoadBackContext)), None)


def _postcheck(pipe: Any, req: Any, loaded: int, node: Any, state: Any, had_anchor: bool) -> RestoreRecord:
    cache = pipe._cache
    request = req.cache_request_handle
    problems: list[str] = []
    prefix_after = req.prefix_len + loaded
    path_len = _path_len(cache, node)
    if path_len != prefix_after:
        problems.append(f"N's device path is {path_len} tokens, request prefix would be {prefix_after}")
    node_slot = _node_mamba_slot(cache, node)
    req_slot = _slot(req.kv.mamba_pool_idx)
    host_slot = copy_slot = None
    ctx = _mamba_context(state) if state is not None else None
    if ctx is not None:
        host_slot = _slot(ctx.node_copy.host_indices)
        copy_slot = _slot(ctx.node_copy.device_indices)
        req_xfer = ctx.load_xfers[0]
        if node_slot is None:
            problems.append("N has no Mamba device value")
        if req_slot is None:
            problems.append("request has no private Mamba slot")
        elif req_slot == node_slot:
            problems.append("request would decode in N's slot (decode mutates it)")
        if _slot(req_xfer.device_indices) != req_slot:
            problems.append(f"the H2D targets slot {_slot(req_xfer.device_indices)}, not the request's {req_slot}")
        if _slot(req_xfer.host_indices) != host_slot:
            problems.append("request and node copies read different host staging slots")
        released = {_slot(t) for _, t in state.aux_device_releases}
        if node_slot is not None and copy_slot != node_slot and copy_slot not in released:
            problems.append(f"node copy slot {copy_slot} is neither N's slot {node_slot} nor released at ack")
    if req.kv.mamba_cow_src_index is not None or req.kv.mamba_needs_clear:
        problems.append(
            f"pending CoW/clear (cow_src={_slot(req.kv.mamba_cow_src_index)}, "
            f"clear={req.kv.mamba_needs_clear}) would overwrite the restored state"
        )
    releases = _pop_releases(request)
    if request in pipe.anchor_locks:
        problems.append("prefetch anchor pin still held")
    if releases != (1 if had_anchor else 0):
        problems.append(f"prefetch anchor pin released {releases}× (held: {had_anchor})")
    if problems:
        metrics.inc("fail_stops")
        raise ReanchorViolation(
            "sglang-l3 reanchor: buffer-only L3 restore violated its invariants after the H2D "
            "copy was queued; stopping to avoid serving wrong state: "
            + _describe(req, node=node, node_slot=node_slot, host_slot=host_slot, loaded=loaded)
            + " — "
            + "; ".join(problems)
        )
    return RestoreRecord(
        rid=str(req.rid),
        anchor_before=req.last_node,
        node=node,
        loaded=loaded,
        prefix_after=prefix_after,
        node_slot=node_slot,
        req_slot=req_slot,
        host_slot=host_slot,
        node_copy_slot=copy_slot,
        load_back_id=-1,
        anchor_releases=releases,
    )


def _pop_releases(request: Any) -> int:
    with _STATE.lock:
        return _STATE.releases.pop(request, 0)


def _init_load_back(original, pipe: Any, params: Any) -> Any:
    req = params.req
    if req is None:
        return original(pipe, params)
    request = req.cache_request_handle
    f = pipe.staged_prefetches.get(request)
    reason = _precheck(pipe, req, f)
    if reason is not None:
        fallback(pipe, req, reason)
        return None
    if f is None:
        return original(pipe, params)
    had_anchor = request in pipe.anchor_locks
    load_back_id = -(f.operation_id) - 1
    with _STATE.lock:
        _STATE.releases[request] = 0
    result = original(pipe, params)
    if result is None:  # capacity: upstream keeps the hold for the next pass
        _pop_releases(request)
        return result
    loaded, node = result
    if load_back_id not in pipe.ongoing_buffer_load_back:
        _pop_releases(request)
        return result  # nothing was queued (upstream's "unchanged" exit)
    state = pipe.ongoing_buffer_load_back[load_back_id]
    rec = _postcheck(pipe, req, int(loaded), node, state, had_anchor)
    rec.load_back_id = load_back_id
    # The re-anchor: bound before anything else can observe the request.
    req.last_node = node
    setattr(req, _RECORD_ATTR, rec)
    with _STATE.lock:
        _STATE.by_request[request] = rec
    metrics.inc("l3_restores")
    if rec.anchor_before != node:
        metrics.inc("reanchors")
    logger.debug("sglang-l3 reanchor: %s bound to node %s (was %s)", req.rid, node, rec.anchor_before)
    return result


def _release_anchor_lock(original, pipe: Any, request: Any) -> Any:
    held = request in pipe.anchor_locks
    out = original(pipe, request)
    if held:
        with _STATE.lock:
            if request in _STATE.releases:
                _STATE.releases[request] += 1
    return out


def _commit_prefill_admission(original, adder: Any, req: Any, admission: Any, *args: Any, **kw: Any) -> Any:
    out = original(adder, req, admission, *args, **kw)
    rec = record_of(req)
    if rec is None or rec.committed:
        return out
    rec.committed = True
    cache = adder.tree_cache
    problems = []
    if req.last_node != rec.node:
        problems.append(f"req.last_node={req.last_node} is not the restored node {rec.node}")
    lock_node = getattr(req.lock, "node", None)
    if lock_node != rec.node:
        problems.append(f"admission lock is on node {lock_node}, not {rec.node}")
    path_len = _path_len(cache, rec.node)
    if req.prefix_len != path_len:
        problems.append(f"req.prefix_len={req.prefix_len} but N's device path is {path_len}")
    if problems:
        metrics.inc("fail_stops")
        raise ReanchorViolation(
            "sglang-l3 reanchor: restored request admitted inconsistently: "
            + _describe(req, node=rec.node, node_slot=rec.node_slot)
            + " — "
            + "; ".join(problems)
        )
    return out


def _sync() -> None:
    """Every queued copy has landed (the verify may run before the load-back's ack, right
    after the batch was chosen: patch tp-verify-restores). Device-agnostic: the device
    module upstream uses (torch.cuda on CUDA/HIP; torch.cpu, or the simulated device, here)."""
    from sglang.srt.utils import get_device_module

    get_device_module().synchronize()


def verify_restored_state(pipe: Any, rec: RestoreRecord) -> list[str]:
    """Compare request slot, N's slot and the host staging slot byte for byte."""
    cache = pipe._cache
    mc = cache.req_to_token_pool.mamba_pool.mamba_cache
    host = cache.cache_controller.mem_pool_host.entry_map
    from sglang.srt.mem_cache.hicache_storage import PoolName

    host_pool = host[PoolName.MAMBA].host_pool if PoolName.MAMBA in host else None
    node_slot = _node_mamba_slot(cache, rec.node)
    problems = []
    dev = [("temporal", mc.temporal)] + [(f"conv{i}", c) for i, c in enumerate(mc.conv)]
    host_tensors = list(host_pool._iter_page_tensors(rec.host_slot)) if host_pool is not None else []
    for i, (name, t) in enumerate(dev):
        a = t[:, rec.req_slot].cpu()
        if node_slot is not None and not torch.equal(a, t[:, node_slot].cpu()):
            problems.append(f"{name}: request slot {rec.req_slot} != node slot {node_slot}")
        if i < len(host_tensors):
            h = host_tensors[i]
            if h.numel() == a.numel() and not torch.equal(a.reshape(-1), h.reshape(-1).to(a.dtype)):
                problems.append(f"{name}: request slot {rec.req_slot} != host staging slot {rec.host_slot}")
    return problems


def verify_now(pipe: Any, rec: RestoreRecord) -> None:
    """SGLANG_L3_VERIFY: compare the restored states now; fail-stop on a difference.

    Valid only before the request's first forward pass (which advances its
    slot): at the ack, or (patch tp-verify-restores) right after the scheduler
    chose the batch - at TP >= 2 the ack is drained by the MIN of the ranks'
    ready counts and can come after that forward."""
    if rec.verified or rec.host_slot is None:
        return
    rec.verified = True
    _sync()
    problems = verify_restored_state(pipe, rec)
    metrics.inc("verify_checks")
    if problems:
        metrics.inc("fail_stops")
        raise ReanchorViolation(
            f"sglang-l3 verify: restored Mamba state differs for req={rec.rid} node={rec.node}: " + "; ".join(problems)
        )


def _try_finish_load_back(original, pipe: Any, ack_id: int) -> Any:
    state = pipe.ongoing_buffer_load_back.get(ack_id)
    rec = None
    if state is not None:
        with _STATE.lock:
            rec = _STATE.by_request.pop(state.request, None)
    if rec is not None and verify_enabled():
        verify_now(pipe, rec)
    return original(pipe, ack_id)


def apply(ctx: PatchContext) -> None:
    ctx.around(f"{PIPE}.init_load_back", _init_load_back)
    ctx.around(f"{PIPE}.release_anchor_lock", _release_anchor_lock)
    ctx.around(f"{PIPE}.try_finish_load_back", _try_finish_load_back)
    ctx.around(f"{ADDER}._commit_prefill_admission", _commit_prefill_admission)
