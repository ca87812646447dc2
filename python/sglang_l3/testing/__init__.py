"""Harnesses: what tests, demos and benchmarks drive, never what a serving process imports.

- `stack`: the real upstream cache stack (UnifiedRadixCache + HybridCacheController +
  buffer-only HiCache + our store) on CPU pools; `stream_landing`: what its
  scheduler-loop stand-in waits on while a streamed restore reads.
- `scheduler_harness`: the real scheduler admission path around that stack.
- `soak`: the randomized restore soak.
- `server`: start, talk to and stop `python -m sglang.launch_server` on the packaged tiny model.
- `demo`, `demo_server`: `make demo`.
- `coverage`: restorable-coverage arithmetic for benchmark/coverage.py.
- `pools`: real upstream host pools and storage configs for store tests and benchmarks.
- `triton_probe`: whether this Triton interpreter runs the GPTQ kernels (the dry runs).

Runtime code (plugin, patches, storage, quant, cpu, cpu_serving, metrics, cli) never
imports this package.
"""
