"""The CPU ports of the `direct` host<->device copies (sglang_l3.cpu.transfer_ops)
against a per-page reference: contiguous, fragmented and reversed index lists,
MHA and MLA, both directions, page sizes 1 and 64; bit-exact, nothing else touched."""

from __future__ import annotations

import pytest
import torch
from sglang_l3.cpu import transfer_ops as ops

LAYERS, HEADS, DIM = 3, 2, 8


def _reference(src_ptrs, dst_ptrs, src_idx, dst_idx, start_layer, ps, lf_to_pf):
    """The kernel's semantics, one page and one layer at a time."""
    host = dst_ptrs if lf_to_pf else src_ptrs
    dev = src_ptrs if lf_to_pf else dst_ptrs
    mla = len(host) == 1
    n_layers = len(dev) if mla else len(dev) // 2
    for i in range(src_idx.numel() // ps):
        s, d = int(src_idx[i * ps]), int(dst_idx[i * ps])
        for j in range(n_layers):
            for half in (0,) if mla else (0, 1):
                dev_t = dev[j + half * n_layers]
                if lf_to_pf:
                    host[half][d // ps, start_layer + j, :ps].copy_(dev_t[s : s + ps])
                else:
                    dev_t[d : d + ps].copy_(host[half][s // ps, start_layer + j, :ps])


def _indices(kind: str, pages: int, ps: int, total_pages: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(pages * 7 + ps)
    if kind == "contiguous":
        first = torch.arange(3, 3 + pages)
    elif kind == "reversed":
        first = torch.arange(3, 3 + pages).flip(0)
    elif kind == "two_runs":
        first = torch.cat([torch.arange(1, 1 + pages // 2), torch.arange(pages + 4, 4 + 2 * pages - pages // 2)])
    else:
        first = torch.randperm(total_pages, generator=g)[:pages]
    return (first.view(-1, 1) * ps + torch.arange(ps)).flatten()


def _pools(mla: bool, ps: int, host_pages: int, dev_tokens: int):
    g = torch.Generator().manual_seed(1)
    n_host = 1 if mla else 2
    host = [torch.randn(host_pages, LAYERS, ps, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(n_host)]
    dev = [
        torch.randn(dev_tokens, HEADS, DIM, generator=g).to(torch.bfloat16) for _ in range(LAYERS * (1 if mla else 2))
    ]
    return host, dev


@pytest.mark.parametrize("ps", [1, 64])
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("kind", ["contiguous", "reversed", "two_runs", "random"])
@pytest.mark.parametrize("pages", [1, 5, 40, 300])
def test_page_first_direct_matches_reference(ps: int, mla: bool, kind: str, pages: int) -> None:
    host_pages = max(64, 2 * pages + 8)
    dev_tokens = host_pages * ps + 8 * ps
    host_idx = _indices(kind, pages, ps, host_pages)
    dev_idx = _indices("random" if kind == "random" else "contiguous", pages, ps, host_pages + 8)
    # host -> device, one layer at a time (load back)
    for layer in range(LAYERS):
        host, dev = _pools(mla, ps, host_pages, dev_tokens)
        ref_dev = [t.clone() for t in dev]
        per_layer_dev = [dev[layer]] if mla else [dev[layer], dev[LAYERS + layer]]
        per_layer_ref = [ref_dev[layer]] if mla else [ref_dev[layer], ref_dev[LAYERS + layer]]
        ops.transfer_kv_per_layer_direct_pf_lf(host, per_layer_dev, host_idx, dev_idx, layer, ps)
        _reference(host, per_layer_ref, host_idx, dev_idx, layer, ps, False)
        assert all(torch.equal(a, b) for a, b in zip(dev, ref_dev, strict=True))
    # device -> host, all layers (backup)
    host, dev = _pools(mla, ps, host_pages, dev_tokens)
    ref_host = [t.clone() for t in host]
    ops.transfer_kv_all_layer_direct_lf_pf(dev, host, dev_idx, host_idx, ps)
    _reference(dev, ref_host, dev_idx, host_idx, 0, ps, True)
    assert all(torch.equal(a, b) for a, b in zip(host, ref_host, strict=True))


@pytest.mark.parametrize("n", [30, 600])
@pytest.mark.parametrize("kind", ["contiguous", "reversed", "two_runs", "random"])
def test_transfer_kv_direct_matches_reference(kind: str, n: int) -> None:
    g = torch.Generator().manual_seed(2)
    src = [torch.randn(2000, 4, generator=g) for _ in range(3)]
    dst = [torch.randn(2000, 4, generator=g) for _ in range(3)]
    ref = [t.clone() for t in dst]
    si = _indices(kind, n, 1, 2000)
    di = _indices("random", n, 1, 2000)
    ops.transfer_kv_direct(src, dst, si, di, 1)
    for s, r in zip(src, ref, strict=True):
        r[di] = s[si]
    assert all(torch.equal(a, b) for a, b in zip(dst, ref, strict=True))


def test_bad_counts_are_errors() -> None:
    host, dev = _pools(False, 4, 8, 64)
    with pytest.raises(ValueError):
        ops.transfer_kv_per_layer_direct_pf_lf(host, dev[:1] + dev[3:4], torch.arange(8), torch.arange(6), 0, 4)
    with pytest.raises(ValueError):
        ops.transfer_kv_per_layer_direct_pf_lf(host, dev[:1] + dev[3:4], torch.arange(6), torch.arange(6), 0, 4)
