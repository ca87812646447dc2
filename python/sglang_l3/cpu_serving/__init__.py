"""Serving the packaged tiny Qwen3-Next (Gated-DeltaNet hybrid) on a host with
no accelerator.

- gdn.py      torch-native Gated-DeltaNet: chunked prefill (fp32 per-chunk
              states for the extra_buffer Mamba cache) and recurrent decode
- conv1d.py   causal depthwise conv1d with a rolling state (prefill, decode)
- ops.py      the small Triton kernels on the path (qkvzba split, gated
              RMSNorm, shared-expert sigmoid gate, Mamba track copies)
- weights.py  per-parameter seeded dummy weights (opt-in by model config)
- server.py   start/stop/query a real `sglang.launch_server` (demo, e2e tests)

They are installed into SGLang by the `cpu-serving` patch group
(sglang_l3/patches/cpu_serving/kernels.py, patches/series.toml), which is "not
applicable" whenever an accelerator is present. Importing this package does
not import sglang.
"""
