"""Patch `session-guard`: the verdict is MAX-reduced over the TP CPU group, so
a hint declined on one rank is declined on every rank (two gloo processes)."""

from __future__ import annotations

import os
import types

import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, init: str, out) -> None:
    from sglang_l3.patches.sessions.session_guard import any_rank

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        sched = types.SimpleNamespace(tp_size=2, tp_cpu_group=dist.group.WORLD)
        out.put((rank, any_rank(sched, rank == 1), any_rank(sched, False)))
    finally:
        dist.destroy_process_group()


def test_one_rank_declining_declines_on_every_rank(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{os.path.join(tmp_path, 'rendezvous')}"
    procs = [ctx.Process(target=_rank, args=(r, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert results == [(0, True, False), (1, True, False)]


def test_single_rank_needs_no_collective():
    from sglang_l3.patches.sessions.session_guard import any_rank

    assert any_rank(types.SimpleNamespace(tp_size=1), True) is True
    assert any_rank(types.SimpleNamespace(), False) is False
