"""Run a block of a test (or a benchmark) on the simulated asynchronous device.

`simulated_device(seed)` sets SGLANG_L3_SIM_STREAMS, applies patch `cpu-sim-streams`
(the CPU switch must be on: `sglang_l3.cpu.enable()`), and on exit drains every
stream, undoes the patch and restores the variable. `threaded=True`: a device thread
runs queued work by itself (a copy engine beside the scheduler; benchmark/stall_bench.py). Build the stacks inside the
block: their streams and events are made at construction.

`SEEDS` are the seeds the integration tests run under (`test/integration/conftest.py`);
`seeds()` is what a run uses: SEEDS, or only the seed of SGLANG_L3_SIM_STREAMS when
the test run is started with it (`SGLANG_L3_SIM_STREAMS=7 pytest ...`: every test of
the simulated-device files under seed 7, each on a fresh device).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from sglang_l3.patches.cpu.sim_streams import ENV

PATCH_ID = "cpu-sim-streams"
SEEDS = (1, 2)


@contextlib.contextmanager
def simulated_device(seed: int, *, threaded: bool = False) -> Iterator[int]:
    from sglang_l3.patches import framework

    spec = next(s for s in framework.load_series() if s.id == PATCH_ID)
    prev = os.environ.get(ENV)
    # Started with SGLANG_L3_SIM_STREAMS set, the process applied the patch already, on a
    # device whose polls earlier tests consumed: this block gets a fresh one of its seed.
    framework.undo(PATCH_ID)
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


def seeds() -> tuple[int, ...]:
    """The seeds this test run uses: only SGLANG_L3_SIM_STREAMS's when it is set (a
    malformed value is an error), else SEEDS."""
    from sglang_l3 import envs
    from sglang_l3.patches.cpu.sim_streams import setting

    if not envs.value(ENV).strip():
        return SEEDS
    seed, threaded = setting()
    if threaded:
        raise ValueError(f"{ENV}: the tests run the queued device; drop ':threaded'")
    return (seed,)


def active() -> bool:
    from sglang_l3.sim import streams as sim_streams

    return sim_streams.installed()
