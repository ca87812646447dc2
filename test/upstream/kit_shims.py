"""Test-only shims that let upstream's unified-radix-cache kits run without a GPU.

1. fixtures.get_device -> "cpu": upstream get_device() raises without an
   accelerator (unless SGLANG_USE_CPU_ENGINE=1, which imports sgl_kernel CPU ops).
2. The kit's _init_hicache hardcodes hicache_io_backend="kernel"; force `direct`
   with `page_first_direct` (what upstream's own Mamba HiCache server test uses).
Host pinning and the direct transfer ops come from sglang_l3.cpu (patch
cpu-host-pools), enabled by test/conftest.py.
"""

from __future__ import annotations

import sglang.test.kits.unified_radix_cache.fixtures as _fixtures
import sglang.test.kits.unified_radix_cache.mixins as _mixins
from sglang.srt.server_args import ServerArgs

_fixtures.get_device = lambda *a, **k: "cpu"


def _direct_server_args(*args, **kwargs):
    if kwargs.get("hicache_io_backend", "kernel") == "kernel":
        kwargs["hicache_io_backend"] = "direct"
        kwargs.setdefault("hicache_mem_layout", "page_first_direct")
    return ServerArgs(*args, **kwargs)


_mixins.ServerArgs = _direct_server_args
