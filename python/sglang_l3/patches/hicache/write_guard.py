"""Patch `write-guard` (why: patches/series.toml): a node whose L3 write is still queued
stays on the device until the write has staged.

Upstream's buffer-only pipeline pins a node only from its D2H launch
(`_stage_backup_intent` → `inc_lock_ref`); an intent still queued when the next
prefill or a restore evicts its node is swept at the next flush, and with a small
host buffer that can be a whole context (its Mamba checkpoint is written last).

How: after every `enqueue_backup_intent` and `flush_pending_writes`, the set of
nodes with a queued intent is reconciled with a set of tree locks taken the way
upstream takes its own (`inc_lock_ref` → `dec_lock_ref` with the receipt): a node
gains a guard when its first intent is queued and loses it when no intent of it is
left in the queue (staged — upstream's own lock takes over — retired or dropped).
A split keeps the node id on the tail (upstream's receipts rely on the same), and
the split's pieces, being ancestors, are held by the same lock until they are
guarded themselves.

The valve: a guarded write waits for host staging, and host staging can be held by
a staged restore that waits for admission, which may wait for the guarded rows. When
the queue's head has not staged for `VALVE_FLUSHES` flushes in a row while a staged
restore holds host staging, and upstream's admission has deferred such a restore for
device capacity since the head stopped (`BufferModePipeline.defer_staged_admission`:
the cycle is real, the restore wants rows), every guard is released until the queue
moves again; a write swept after that is counted as before
(`l3_write_dropped{evicted}`), the release as `l3_write_guard{released}`. A staged
restore that merely waits its turn (behind `--max-running-requests`, a running
prefill) never opens it: flushes run on every scheduler tick, so eight of them take
milliseconds, and the valve used to open then, sweeping the queued writes of a
context that then had to be recomputed (issue 49).

Every input is TP-identical (the queue and the staged restores follow MIN-reduced
acks, flushes run at the same lockstep point), so every rank guards and releases the
same nodes without a collective.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sglang_l3 import metrics
from sglang_l3.patches.framework import PatchContext

logger = logging.getLogger("sglang_l3.write_guard")

PIPE = "sglang.srt.mem_cache.buffer_mode.pipeline:BufferModePipeline"
VALVE_FLUSHES = 8  # flushes the head may sit blocked behind a staged restore


@dataclasses.dataclass
class _Guards:
    locks: dict[Any, tuple[Any, int]] = dataclasses.field(default_factory=dict)  # node -> (receipt, tokens)
    blocked: int = 0  # consecutive flushes without progress while a staged restore holds host staging
    open: bool = False  # the valve: no guards until the queue moves
    # upstream's device-capacity deferrals per staged restore when the head stopped
    defers_at_block: dict[Any, int] = dataclasses.field(default_factory=dict)


def _guards(pipe: Any) -> _Guards:
    g = pipe.__dict__.get("_l3_write_guard")
    if g is None:
        g = pipe.__dict__["_l3_write_guard"] = _Guards()
    return g


def guarded_tokens(pipe: Any) -> int:
    """Device tokens held on the device only because their node's write is queued
    (each guarded node's own span; 0 without the patch or while the valve is open)."""
    g = pipe.__dict__.get("_l3_write_guard")
    return 0 if g is None else sum(t for _, t in g.locks.values())


def write_held_tokens(pipe: Any) -> int:
    """Device tokens kept for L3 writes that will free them without anyone's help: the
    guarded nodes' spans and those of nodes whose D2H copy is in flight (upstream's own
    lock, released at the D2H ack), each node once. 0 without the patch."""
    g = pipe.__dict__.get("_l3_write_guard")
    if g is None:
        return 0
    held = {node: tokens for node, (_, tokens) in g.locks.items()}
    for entry in pipe.ongoing_write_through.values():
        snap = entry.intent.snapshot
        held.setdefault(snap.node_id, len(snap.key))
    return sum(held.values())


def guarded_nodes(pipe: Any) -> set[Any]:
    g = pipe.__dict__.get("_l3_write_guard")
    return set() if g is None else set(g.locks)


def _reconcile(pipe: Any) -> None:
    g = _guards(pipe)
    cache = pipe._cache
    want: dict[Any, int] = {}
    if not g.open:
        for intent in pipe.pending_write_queue:
            want.setdefault(intent.snapshot.node_id, len(intent.snapshot.key))
    for node in [n for n in g.locks if n not in want]:
        receipt, _ = g.locks.pop(node)
        cache.dec_lock_ref(node, receipt)
    for node, tokens in want.items():
        if node in g.locks:
            continue
        # Only a node still whole on the device: a split or evicted one is either held
        # by the guard it had before, or swept by upstream's next refresh.
        if cache.tree_core.validate_buffer_backup(node, tokens) is None:
            continue
        g.locks[node] = (cache.inc_lock_ref(node).to_dec_params(), tokens)


def apply(ctx: PatchContext) -> None:
    def enqueue(orig: Any, self: Any, node_id: Any) -> None:
        orig(self, node_id)
        _reconcile(self)

    def flush(orig: Any, self: Any) -> None:
        seq = self._backup_ack_seq
        orig(self)
        g = _guards(self)
        if self._backup_ack_seq != seq or not self.pending_write_queue:
            g.blocked, g.open = 0, False
        elif self.staged_prefetches and not g.open:
            defers = self._staged_admission_defers
            if g.blocked == 0:
                g.defers_at_block = {r: defers.get(r, 0) for r in self.staged_prefetches}
            g.blocked += 1
            refused = any(defers.get(r, 0) > g.defers_at_block.get(r, 0) for r in self.staged_prefetches)
            if g.blocked >= VALVE_FLUSHES and refused and g.locks:
                g.open = True
                metrics.inc("l3_write_guard", "released")
                logger.warning(
                    "L3 write guard released: %d queued node(s) (%d tokens) may be evicted; the "
                    "queue's head waited %d flushes for host staging a staged restore holds",
                    len(g.locks),
                    guarded_tokens(self),
                    g.blocked,
                )
        else:
            g.blocked = 0
        _reconcile(self)

    def reset(orig: Any, self: Any) -> None:
        orig(self)
        # Called from the cache's reset, after the tree's: the locks went with it.
        self.__dict__.pop("_l3_write_guard", None)

    ctx.around(f"{PIPE}.enqueue_backup_intent", enqueue)
    ctx.around(f"{PIPE}.flush_pending_writes", flush)
    ctx.around(f"{PIPE}.reset", reset)
