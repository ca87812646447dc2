"""Pure-torch ports of sgl_kernel.kvcacheio's `direct` host<->device copies.

sgl-kernel/csrc/kvcacheio/transfer.cu implements transfer_kv_direct and the
page_first_direct variants as slice/select + copy_, so they port 1:1. The
pool_host modules bind these names only under CUDA/HIP/XPU/NPU; on a CPU-only
host they are injected by `sglang_l3.cpu.enable()`.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch


def _runs(src_idx: torch.Tensor, dst_idx: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """Maximal runs contiguous in both index lists: (src_start, dst_start, n)."""
    s, d = src_idx.tolist(), dst_idx.tolist()
    start = 0
    for i in range(len(s)):
        if i + 1 < len(s) and s[i + 1] - s[i] == 1 and d[i + 1] - d[i] == 1:
            continue
        yield s[start], d[start], i + 1 - start
        start = i + 1


def _check(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("src/dst index counts differ")
    if page_size <= 0 or src_indices.numel() % page_size:
        raise ValueError(f"index count {src_indices.numel()} is not a multiple of page {page_size}")


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    if len(src_layers) != len(dst_layers):
        raise ValueError("src/dst layer counts differ")
    _check(src_indices, dst_indices, page_size)
    for s, d, n in _runs(src_indices.cpu(), dst_indices.cpu()):
        for src, dst in zip(src_layers, dst_layers):
            dst.narrow(0, d, n).copy_(src.narrow(0, s, n))


def _page_first_direct(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    start_layer_id: int,
    page_size: int,
    layer_first_to_page_first: bool,
) -> None:
    _check(src_indices, dst_indices, page_size)
    src_cpu, dst_cpu = src_indices.cpu(), dst_indices.cpu()
    host = dst_ptrs if layer_first_to_page_first else src_ptrs
    dev = src_ptrs if layer_first_to_page_first else dst_ptrs
    is_mla = len(host) == 1
    num_layers = len(dev) if is_mla else len(dev) // 2
    for i in range(src_cpu.numel() // page_size):
        s = int(src_cpu[i * page_size])
        d = int(dst_cpu[i * page_size])
        for j in range(num_layers):
            for half in (0,) if is_mla else (0, 1):
                dev_t = dev[j + half * num_layers]
                if layer_first_to_page_first:
                    host_page = host[half].select(0, d // page_size)
                    host_page.select(0, start_layer_id + j).narrow(0, 0, page_size).copy_(dev_t.narrow(0, s, page_size))
                else:
                    host_page = host[half].select(0, s // page_size)
                    dev_t.narrow(0, d, page_size).copy_(host_page.select(0, start_layer_id + j).narrow(0, 0, page_size))


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size) -> None:
    _page_first_direct(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size, False)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size) -> None:
    _page_first_direct(src_ptrs, dst_ptrs, src_indices, dst_indices, 0, page_size, True)


OPS = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}

# Modules that call the ops by their bare name (bound at import under CUDA/HIP).
HOST_POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.dsa",
)
