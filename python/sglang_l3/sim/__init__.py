"""The simulated device: test machinery in one room.

`streams`: a seeded asynchronous device for CPU runs (installed by patch
`cpu-sim-streams`); `harness`: run a block on it. Runtime code never imports this
package, except the one gate that loads it only when asked (the patch); the
simulator imports the runtime's test-fault switch (`sglang_l3.faults`), never the
other way round: test/unit/test_layering.py checks it."""
