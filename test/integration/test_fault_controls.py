"""The test faults (`sglang_l3.faults`, SGLANG_L3_TEST_FAULT) do what the tests that
rely on them say (issue 33 item 5):

- skip-load-fence is the negative control of the streamed restore's fence on the
  forward stream: with it set, `test_a_forward_in_flight_lands_before_the_piece_copy`
  fails (run in a subprocess, as `make test` runs the file; both page sizes);
- stream-hold@PATH holds a streamed restore's reads while PATH exists and releases
  them when it is removed (what test/e2e/test_burst_server.py queues requests with);
- neither is honoured where the CPU switch is off (unit: test/unit/test_faults.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from sglang_l3 import faults, metrics
from sglang_l3.patches.hicache.streamed_restore import lane_of
from streamed_support import back_to_baseline, context, make_spec, pump, reader, write

HERE = Path(__file__).resolve().parent
FENCE_TEST = "test_streamed_restore_async.py::test_a_forward_in_flight_lands_before_the_piece_copy"


def _run_with_fault(fault: str, node: str) -> tuple[int, str]:
    env = dict(os.environ, **{faults.ENV: fault})
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(HERE / node)],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE.parent.parent,
        timeout=600,
    )
    return out.returncode, out.stdout[-4000:] + out.stderr[-2000:]


def test_skip_load_fence_fails_the_fence_test() -> None:
    rc, log = _run_with_fault(faults.SKIP_LOAD_FENCE, FENCE_TEST)
    summary = re.search(r"(\d+) failed(?:, (\d+) passed)?", log)
    assert rc == 1 and summary is not None, f"with {faults.SKIP_LOAD_FENCE} the fence test must fail:\n{log}"
    assert int(summary.group(1)) >= 2 and summary.group(2) is None, log  # every page size and seed run


def test_stream_hold_holds_reads_until_the_gate_goes(tmp_path, monkeypatch) -> None:
    spec = make_spec(64, 8 * (256 + 64))
    seq = context(spec, 8)
    (want,) = write(spec, tmp_path, "rust", [seq])
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setenv(faults.ENV, f"{faults.STREAM_HOLD}@{gate}")
    with reader(spec, tmp_path, "rust") as st:
        assert faults.active(faults.STREAM_HOLD)
        pieces = metrics.get("l3_stream_restore_pieces")
        h = st.start_prefetch(seq, "r")
        lane = lane_of(st.cache.buffer_pipeline)
        pump(st, lambda: h in lane.streams, "the stream to start")
        for _ in range(200):
            st.cache.check_hicache_events()
        s = lane.streams[h]
        assert s.landed_pages == 0 and metrics.get("l3_stream_restore_pieces") == pieces, "held: no read"
        gate.unlink()
        bp = st.cache.buffer_pipeline
        pump(st, lambda: st.cache.check_prefetch_progress(h) and bp.has_staged(h), "the stream to stage")
        assert st.cache.pop_prefetch_loaded_tokens(h) == len(seq)
        req, loaded = st.admit(h, seq, "r")
        st.check_restored(seq, req, loaded, want, kv=True)
        back_to_baseline(st, req)
