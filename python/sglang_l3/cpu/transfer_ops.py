"""Pure-torch ports of sgl_kernel.kvcacheio's `direct` host<->device copies.

sgl-kernel/csrc/kvcacheio/transfer.cu implements transfer_kv_direct and the
page_first_direct variants as slice/select + copy_, so they port 1:1. The
pool_host modules bind these names only under CUDA/HIP/XPU/NPU; on a CPU-only
host they are injected by `sglang_l3.cpu.enable()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _runs(src_idx: torch.Tensor, dst_idx: torch.Tensor, step: int = 1) -> list[tuple[int, int, int]]:
    """Maximal runs contiguous in both index lists, over every `step`-th index:
    (src_start, dst_start, n) with n counted in steps. Called once per layer:
    short lists (a piece's pages) in Python, long ones with tensor ops."""
    s, d = src_idx[::step], dst_idx[::step]
    if s.numel() <= 256:
        sl, dl = s.tolist(), d.tolist()
        out, start = [], 0
        for i in range(1, len(sl) + 1):
            if i == len(sl) or sl[i] - sl[i - 1] != step or dl[i] - dl[i - 1] != step:
                out.append((sl[start], dl[start], i - start))
                start = i
        return out
    s, d = s.long(), d.long()
    brk = ((s[1:] - s[:-1]) != step) | ((d[1:] - d[:-1]) != step)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), brk.nonzero().flatten() + 1])
    lens = torch.diff(starts, append=torch.tensor([s.numel()]))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lens.tolist(), strict=True))


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
    src_cpu, dst_cpu = src_indices.cpu(), dst_indices.cpu()
    runs = _runs(src_cpu, dst_cpu)
    for s, d, n in runs:
        for src, dst in zip(src_layers, dst_layers, strict=True):
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
    """Host buffers are [page, layer, page_size, ...]; device buffers [token, ...],
    one per layer (K layers then V layers; MLA: one host buffer, one per layer).
    A page's tokens are contiguous on both sides, so each run of whole pages
    contiguous on both sides is one strided copy_ per layer (a freshly allocated
    piece is one or a few runs; fragmented lists degrade to a copy per page, as
    the kernel's port did. index_select/index_copy_ on the strided bf16 host
    view measured slower than either on CPU)."""
    _check(src_indices, dst_indices, page_size)
    ps = page_size
    src_cpu, dst_cpu = src_indices.cpu().long(), dst_indices.cpu().long()
    host = dst_ptrs if layer_first_to_page_first else src_ptrs
    dev = src_ptrs if layer_first_to_page_first else dst_ptrs
    is_mla = len(host) == 1
    num_layers = len(dev) if is_mla else len(dev) // 2
    halves = (0,) if is_mla else (0, 1)
    host_idx, dev_idx = (dst_cpu, src_cpu) if layer_first_to_page_first else (src_cpu, dst_cpu)
    # Runs of whole pages: host page numbers step by 1, device tokens by ps.
    runs = _runs(host_idx // ps * ps, dev_idx, ps)
    for hs, d, n in runs:
        for j in range(num_layers):
            for half in halves:
                dev_t = dev[j + half * num_layers]
                h = host[half].narrow(0, hs // ps, n).select(1, start_layer_id + j).narrow(1, 0, ps)
                dv = dev_t.narrow(0, d, n * ps).unflatten(0, (n, ps))
                if layer_first_to_page_first:
                    h.copy_(dv)
                else:
                    dv.copy_(h)


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
