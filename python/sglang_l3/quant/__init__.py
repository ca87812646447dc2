"""GPTQ on ROCm (RDNA3): torch reference format code, Triton fused dequant-GEMM,
per-layer kernel dispatch with a load-time self-check, and the ROCm GPTQ config.

Modules:
  gptq_ref     pack / unpack / dequantize / RTN quantizer / v1-v2 detection (torch)
  gptq_triton  Triton kernels (GEMV and split-K decode paths, tl.dot tiles), launch
               configs per architecture, AOT compile report (gfx1100, sm90)
  dispatch     native op discovery, kernel order, self-check, decisions
  rocm_gptq    RocmGPTQConfig + linear scheme (imports sglang; loaded by the patch)
  doctor       report() for `sglang-l3 doctor`
"""
