"""Group `quant`: GPTQ on ROCm RDNA3 (dispatch to `sglang_l3.quant`, self-checked)."""
