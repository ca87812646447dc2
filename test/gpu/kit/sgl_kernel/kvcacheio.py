"""TEST-ONLY `sgl_kernel.kvcacheio`: the three `direct` KV copies the host pools
call with `--hicache-io-backend direct --hicache-mem-layout page_first_direct`,
bound from sglang_l3's torch port; any other name is a stub that raises when
called (see the package docstring)."""

from __future__ import annotations

from sglang_l3.cpu.transfer_ops import (
    OPS,
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_direct,
    transfer_kv_per_layer_direct_pf_lf,
)

from . import missing_getattr

__all__ = [
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
]
if set(__all__) != set(OPS):
    raise ImportError("sglang_l3.cpu.transfer_ops.OPS changed: update the kit shim (test/gpu/kit/sgl_kernel)")

__getattr__ = missing_getattr(__name__)
