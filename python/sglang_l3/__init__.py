"""sglang-l3: SSD-backed HiCache L3 for hybrid models and GPTQ on RDNA3, as a
plugin over a pinned SGLang (see patches/series.toml)."""

__version__ = "0.1.0"
SGLANG_PIN = "0.5.23"
