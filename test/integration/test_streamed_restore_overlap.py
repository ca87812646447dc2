"""Streamed restore overlaps the store's read of the next piece with the copy of the
landed one (`streamed-restore`, issue 34: `restore_bench` at 32K read one piece, then
copied it, then read the next; 131K restored at 0.71x the store's read with the 1/16
buffer).

Real upstream stack on CPU (`L3Stack`), where a copy runs on the scheduler thread when
it is queued (as on the CPU server; on a GPU, queueing per-page copies takes a while
too). One read in flight per stream (`MAX_INFLIGHT` = 1), so the order inside a tick
alone decides the overlap: when the copy of every piece but the last is queued, the
next piece's read must already be in flight. Without the fix (reads launched after the
copies) no copy has one. Not on the simulated device: there a copy holds its host slots
until the device completes it, so whether the next read fits beside it depends on the
seed, not on the order.
"""

from __future__ import annotations

import pytest
from sglang_l3.patches.hicache import streamed_restore as sr
from sglang_l3.patches.hicache.streamed_restore import lane_of
from sglang_l3.testing.stack import HybridSpec, L3Stack
from streamed_support import back_to_baseline

PAGE = 64


@pytest.mark.parametrize("core", ("rust", "python"))
def test_next_read_is_in_flight_while_a_piece_is_copied(tmp_path, monkeypatch, core: str) -> None:
    spec = HybridSpec(page_size=PAGE, kv_size=8192, max_context_len=4096)
    args = {"hicache_ratio": 256 / spec.kv_size}  # 5 pages of host buffer, pieces of 2
    seq = list(range(7, 7 + 40 * PAGE))
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args=args) as w:
        want = w.write(seq, marker=3.0)
        w.settle()
        assert not w.cache.buffer_pipeline.inflight_backup_pools

    monkeypatch.setattr(sr, "MAX_INFLIGHT", 1)
    copy = sr._copy_to_device
    in_flight: list[bool] = []  # per piece copy: a read of a later piece was in flight
    with L3Stack(spec, str(tmp_path), tree_core=core, server_args=args) as st:
        lane = lane_of(st.cache.buffer_pipeline)
        assert st.cache.cache_controller.mem_pool_host.size == 5 * PAGE

        def traced_copy(cc, host, rows, rows_host):
            (s,) = lane.streams.values()
            in_flight.append(bool(s.pieces))
            return copy(cc, host, rows, rows_host)

        monkeypatch.setattr(sr, "_copy_to_device", traced_copy)
        st.scribble()
        req, loaded = st.restore(seq, "overlap")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)
    assert len(in_flight) >= 8, in_flight
    assert in_flight == [True] * (len(in_flight) - 1) + [False], in_flight
