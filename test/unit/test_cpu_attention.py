"""Patch cpu-attention-invariant: the CPU server's causal extend attention gives a
token the same output, bit for bit, however its prefill is chunked (a cached prefix
is one more way to chunk it). Upstream's method, run on the same inputs, does not
(negative control): the reason a cache and a no-cache server differed in the last
bits with the same KV."""

from __future__ import annotations

import pytest
import torch
from sglang_l3.cpu_serving.attention import BLOCK, sdpa_forward_extend

T, H, HK, D = 1100, 6, 2, 64  # GQA as in the tiny models
SPLITS = ([], [256, 512, 768, 1024], [512, 1024], [100, 333, 900], [16, 640, 1088], [1, 2, 1099])


def _upstream():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    fn = TorchNativeAttnBackend._run_sdpa_forward_extend
    return getattr(fn, "__wrapped__", None) or getattr(fn, "__sglang_l3_original__", None) or fn


def _inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = (torch.randn(T, HK, D, generator=g) * 3).to(dtype)
    v = torch.randn(T, HK, D, generator=g).to(dtype)
    return q, k, v


def _run(method, q, k, v, splits: list[int]) -> torch.Tensor:
    """Prefill the whole sequence in chunks ending at `splits` (then T); the rows."""
    outs, start, total = [], 0, q.shape[0]
    for end in [*splits, total]:
        out = torch.empty(end - start, H, D, dtype=q.dtype)
        method(
            None,
            q[start:end],
            out,
            k,
            v,
            torch.arange(total).unsqueeze(0),
            torch.tensor([0]),
            torch.tensor([end]),
            torch.tensor([start]),
            torch.tensor([end - start]),
            None,
            scaling=D**-0.5,
            enable_gqa=True,
            causal=True,
        )
        outs.append(out)
        start = end
    return torch.cat(outs)


def _patched(*args, **kwargs):
    return sdpa_forward_extend(_upstream(), *args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_any_chunking_gives_the_same_rows(dtype: torch.dtype) -> None:
    q, k, v = _inputs(dtype)
    whole = _run(_patched, q, k, v, [])
    for splits in SPLITS[1:]:
        assert torch.equal(_run(_patched, q, k, v, splits), whole), splits


def test_matches_upstream_within_rounding() -> None:
    q, k, v = _inputs(torch.float32)
    ours, theirs = _run(_patched, q, k, v, [512]), _run(_upstream(), q, k, v, [512])
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()


def test_negative_control_upstream_depends_on_the_chunking() -> None:
    q, k, v = _inputs(torch.float32)
    whole = _run(_upstream(), q, k, v, [])
    assert any(not torch.equal(_run(_upstream(), q, k, v, s), whole) for s in SPLITS[1:])


def test_rows_outside_a_block_and_other_paths() -> None:
    """A chunk shorter than a block, starting mid-block; non-causal calls keep upstream's path."""
    q, k, v = _inputs(torch.float32)
    short = _run(_patched, q[: BLOCK + 7], k[: BLOCK + 7], v[: BLOCK + 7], [3, BLOCK + 1])
    assert torch.equal(short, _run(_patched, q, k, v, [])[: BLOCK + 7])
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return args[2]

    out = torch.empty(4, H, D)
    sdpa_forward_extend(
        original,
        None,
        q[:4],
        out,
        k,
        v,
        torch.arange(T).unsqueeze(0),
        torch.tensor([0]),
        torch.tensor([4]),
        torch.tensor([0]),
        torch.tensor([4]),
        None,
        causal=False,
    )
    assert calls and calls[0]["causal"] is False
