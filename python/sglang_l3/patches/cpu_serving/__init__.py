"""Group `cpu-serving`: serving the packaged tiny hybrids with `--device cpu` (upstream's
ops routed to `sglang_l3.cpu_serving`'s torch kernels, batch-invariant attention and
linears, gloo for TP=2) and the test server's scripted decode. Active only with the
CPU switch, never next to an accelerator."""
