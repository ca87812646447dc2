"""The simulated device and the test faults: test machinery in one room.

`streams`: a seeded asynchronous device for CPU runs (installed by patch
`cpu-sim-streams`); `harness`: run a block on it; `faults`: the machinery behind
`sglang_l3.faults`. Runtime code never imports this package, except the two gates
that load it only when asked (the patch, and the fault interface while
SGLANG_L3_TEST_FAULT is set): test/unit/test_layering.py checks it."""
