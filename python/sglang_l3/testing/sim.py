"""Run a block of a test (or a benchmark) on the simulated asynchronous device.

`simulated_device(seed)` sets SGLANG_L3_SIM_STREAMS, applies patch `cpu-sim-streams`
(the CPU switch must be on: `sglang_l3.cpu.enable()`), and on exit drains every
stream, undoes the patch and restores the variable. `threaded=True`: a device thread
runs queued work by itself (a copy engine beside the scheduler; benchmark/stall_bench.py). Build the stacks inside the
block: their streams and events are made at construction.

`SEEDS` are the seeds the integration tests run under (`test/integration/conftest.py`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from sglang_l3.patches.cpu_sim_streams import ENV

PATCH_ID = "cpu-sim-streams"
SEEDS = (1, 2)


@contextlib.contextmanager
def simulated_device(seed: int, *, threaded: bool = False) -> Iterator[int]:
    from sglang_l3.patches import framework

    spec = next(s for s in framework.load_series() if s.id == PATCH_ID)
    prev = os.environ.get(ENV)
    os.environ[ENV] = f"{seed}:threaded" if threaded else str(seed)
    try:
        st = framework.apply_one(spec)
        if st.state is not framework.State.APPLIED:
            raise RuntimeError(f"{PATCH_ID}: {st.state.value} ({st.detail})")
        yield seed
    finally:
        framework.undo(PATCH_ID)
        if prev is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = prev


def active() -> bool:
    from sglang_l3.cpu import sim_streams

    return sim_streams.installed()
