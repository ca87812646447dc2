"""TP agreement primitives of patch tp-verify-restores / tp-agreed-flush over a
real two-process gloo group (no server), and the TP=2 launch settings of
sglang_l3.testing.server. The server-level proofs are test/e2e/test_tp2_l3.py."""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
from sglang_l3.testing.server import CRASH_DIAGNOSTICS, ServerConfig, omp_threads_bind


def test_server_config_tp2_flag_and_thread_binding() -> None:
    one = ServerConfig(storage_dir=None)
    assert "--tp-size" not in one.args(1234)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in one.server_env()
    two = ServerConfig(storage_dir=None, tp_size=2)
    a = two.args(1234)
    assert a[a.index("--tp-size") + 1] == "2"
    bind = two.server_env()["SGLANG_CPU_OMP_THREADS_BIND"]
    assert len(bind.split("|")) == 2 and all(bind.split("|")), bind
    assert len(omp_threads_bind(3).split("|")) == 3  # more ranks than cores: shared
    # an explicit env wins over the derived one (applied after it in Server.start)
    assert ServerConfig(tp_size=2, env={"SGLANG_CPU_OMP_THREADS_BIND": "0|0"}).env
    # GPU servers need no CPU binding: what is left is upstream's crash diagnostics
    # switched off (ServerConfig.crash_diagnostics), unless this environment names them
    gpu = ServerConfig(tp_size=2, device="cuda").server_env()
    assert set(gpu) <= set(CRASH_DIAGNOSTICS) and all(v == "0" for v in gpu.values()), gpu
    assert ServerConfig(tp_size=2, device="cuda", crash_diagnostics=True).server_env() == {}


def _worker(rank: int, init: str, scenario: str, q: mp.Queue) -> None:
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        group = dist.new_group([0, 1], backend="gloo")
        from sglang_l3.patches.tp import agreement as ta

        out: dict = {
            "min": ta.agree(group, rank == 0),
            "max": ta.agree(group, rank == 0, all_ranks=False),
        }
        ta._PENDING.clear()
        ta.check_decisions(group)  # nothing restored anywhere: no gather
        ta._PENDING.append(ta.Decision("r1", 384, 384))
        ta.check_decisions(group)  # the same decision on both ranks
        if scenario == "disagree":
            ta._PENDING.append(ta.Decision("r2", 384 if rank == 0 else -1, 384 if rank == 0 else 0))
        elif scenario == "one-sided" and rank == 1:
            ta._PENDING.append(ta.Decision("r2", 256, 256))
        try:
            ta.check_decisions(group)
            out["raised"] = None
        except ta.RankDisagreement as e:
            out["raised"] = str(e)
        dist.destroy_process_group()
        q.put((rank, out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, {"error": traceback.format_exc()}))


def _run(scenario: str, tmp_path) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path}/rendezvous-{scenario}"
    procs = [ctx.Process(target=_worker, args=(r, init, scenario, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, res = q.get(timeout=300)
        out[rank] = res
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    for r, res in out.items():
        assert "error" not in res, f"rank {r}: {res['error']}"
    return out


@pytest.mark.parametrize("scenario", ["agree", "disagree", "one-sided"])
def test_verify_gathers_decisions_and_stops_on_difference(scenario: str, tmp_path) -> None:
    out = _run(scenario, tmp_path)
    for rank in (0, 1):
        assert out[rank]["min"] is False and out[rank]["max"] is True
    if scenario == "agree":
        assert out[0]["raised"] is None and out[1]["raised"] is None
        return
    # both ranks stop, and both name every rank's records
    for rank in (0, 1):
        msg = out[rank]["raised"]
        assert msg is not None and "TP ranks made different L3 restore decisions" in msg
        assert "TP rank 0: [" in msg and "TP rank 1: [" in msg, msg
    if scenario == "disagree":
        assert "req=r2 restored=384" in out[0]["raised"] and "req=r2 restored=-1" in out[0]["raised"]
    else:
        assert "TP rank 0: []" in out[0]["raised"] and "req=r2 restored=256" in out[0]["raised"]
