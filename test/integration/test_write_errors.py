"""Issue 48 (second part), through upstream's real buffer-only pipeline: pages whose
L3 write failed reach L3 once the fault ends, without a flush, so the next turn of
the same conversation is restorable from L3 in a fresh process.

Upstream believes every acknowledged write stored, failed or not
(`BufferModePipeline.finish_storage_write_ack` feeds the existence beliefs
unconditionally), so the next turn writes only its own new pages; before the store
retried failed pages, they sat above a hole and the fresh process restored nothing.
The fault is injected (a test-only one: `os.pwritev` raises EIO while patched), in
this test only. It runs on the simulated asynchronous device (`sim.harness`, the
first seed of the run), entered here.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
from sglang_l3.sim.harness import seeds, simulated_device
from sglang_l3.testing.stack import HybridSpec, L3Stack


def _eio(*_a: object) -> int:
    raise OSError(errno.EIO, "injected")


def _page_files(root: str) -> list[str]:
    return os.listdir(os.path.join(root, "pages"))


@pytest.mark.sim_only
def test_failed_writes_reach_l3_after_the_fault_without_a_flush(
    tmp_path, core: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with simulated_device(seeds()[0]):
        spec = HybridSpec(page_size=4, kv_size=2048)
        turn1 = list(range(1, 33))  # 8 pages and a state
        turn2 = turn1 + list(range(100, 116))  # the next turn: 4 more pages and a state
        with L3Stack(spec, str(tmp_path), tree_core=core) as st:
            store = st.cache.cache_controller.storage_backend.store
            store.retry_first_s, store.retry_max_s = 0.05, 0.2  # the policy's shape, quicker
            monkeypatch.setattr(os, "pwritev", _eio)
            st.write(turn1)  # written through to L3 and acknowledged: every page failed
            c = store.counters.snapshot()
            assert c.get("write_errors", 0) >= 9 and c.get("write_ok", 0) == 0, c  # 8 KV pages + the state
            assert _page_files(str(tmp_path)) == []
            monkeypatch.undo()  # the fault ends
            st.write(turn2)  # the next turn, while turn 1 is still on the device; no flush
            deadline = time.monotonic() + 120
            while store.counters.get("write_retried_ok") < 9:
                assert time.monotonic() < deadline, f"turn 1's pages never reached L3: {store.counters.snapshot()}"
                time.sleep(0.02)
            assert store.counters.get("write_retry_dropped") == 0
        with L3Stack(spec, str(tmp_path), tree_core=core) as fresh:
            req, loaded = fresh.restore(turn2 + [900, 901, 902, 903], "after-the-fault")
            assert loaded == len(turn2)
            fresh.verify_restored(turn2, req, loaded, 1.0)
            fresh.release(req)
