"""Patch cpu-linear-invariant: on CPU a token's linear-layer and lm_head output does
not depend on how many rows share its batch, bit for bit, under every ISA oneDNN may
pick (checked in fresh processes with ONEDNN_MAX_CPU_ISA caps: the cap is read once,
when oneDNN starts). Plain F.linear does not under AVX512_CORE, the kernels of a CPU
without AVX512-BF16 (negative control): the reason the TP=2 soak's cached answers
differed from the no-cache server's in the last bits (issue 24)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from sglang_l3.cpu_serving.linear import BLOCK, compute_lm_head, linear_apply, linear_apply_into, linear_rows

SHAPES = ((128, 256), (256, 128), (128, 1024), (64, 1050), (512, 128))  # (K, N): the tiny models' linears and heads
BATCHES = (2, 3, 7, 16, 17, 30, 47, 63, 64, 65, 100, 200)
OFFSETS = (0, 5, 64)

PROBE = """
import json, sys, torch, torch.nn.functional as F
from sglang_l3.cpu_serving.linear import linear_rows
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[1]))
shapes, batches, offsets = json.loads(sys.argv[2])
bad = {"plain": 0, "rows": 0}
for k, n in shapes:
    w = (torch.randn(n, k) * 0.05).bfloat16()
    x = torch.randn(300, k).bfloat16()
    for name, fn in (("plain", F.linear), ("rows", linear_rows)):
        alone = torch.cat([fn(x[i : i + 1], w) for i in range(300)])
        for start in offsets:
            for m in batches:
                bad[name] += not torch.equal(fn(x[start : start + m], w), alone[start : start + m])
print("RESULT " + json.dumps(bad))
"""


MOE_PROBE = """
import json, sys, torch
from sglang.srt.layers.moe import fused_moe_native as native
from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
from sglang.srt.layers.moe.topk import StandardTopKOutput
from sglang_l3.cpu_serving.linear import moe_forward_native
torch.manual_seed(0)
torch.set_num_threads(1)
E, H, I, T = 4, 128, 64, 320  # the tiny Qwen3-Next's experts; 256-token chunks route ~128 tokens to each
layer = torch.nn.Module()
layer.num_experts = E
layer.w13_weight = torch.nn.Parameter((torch.randn(E, 2 * I, H) * 0.05).bfloat16(), requires_grad=False)
layer.w2_weight = torch.nn.Parameter((torch.randn(E, H, I) * 0.05).bfloat16(), requires_grad=False)
x = torch.randn(T, H).bfloat16()
ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)]).int()
w = torch.rand(T, 2)
cfg = MoeRunnerConfig(num_experts=E, top_k=2)
plain = native.moe_forward_native
fns = {"plain": plain, "rows": lambda *a: moe_forward_native(plain, *a)}
bad = {}
for name, fn in fns.items():
    def run(a, b):
        return fn(layer, x[a:b], StandardTopKOutput(w[a:b], ids[a:b], None), cfg)
    alone = torch.cat([run(i, i + 1) for i in range(T)])
    bad[name] = sum(not torch.equal(run(a, b), alone[a:b]) for a, b in ((0, T), (0, 256), (64, T), (5, 290)))
assert native.F is torch.nn.functional
print("RESULT " + json.dumps(bad))
"""


def _probe(isa: str | None, threads: int = 1, script: str = PROBE) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    args = json.dumps([SHAPES, BATCHES, OFFSETS])
    out = subprocess.run(
        [sys.executable, "-c", script, str(threads), args], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _has_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


@pytest.mark.parametrize("isa", [None, "AVX2", "AVX512_CORE", "AVX512_CORE_BF16"], ids=str)
def test_a_row_is_the_same_in_any_batch_under_every_isa(isa: str | None) -> None:
    assert _probe(isa)["rows"] == 0


def test_with_two_threads() -> None:
    assert _probe("AVX512_CORE", threads=2)["rows"] == 0


def test_negative_control_plain_linear_depends_on_the_batch() -> None:
    if not _has_avx512():
        pytest.skip("this CPU has no AVX512: oneDNN cannot run the AVX512_CORE kernels that vary")
    assert _probe("AVX512_CORE")["plain"] > 0


@pytest.mark.parametrize("isa", [None, "AVX512_CORE"], ids=str)
def test_moe_experts_are_row_invariant(isa: str | None) -> None:
    """Upstream's CPU MoE path (one F.linear pair per expert over the tokens routed to
    it: M changes with the batch) gives a token the same output in any batch through
    the patch; plain, under AVX512_CORE, it does not (negative control)."""
    bad = _probe(isa, script=MOE_PROBE)
    assert bad["rows"] == 0
    if isa == "AVX512_CORE" and _has_avx512():
        assert bad["plain"] > 0


def test_same_values_as_f_linear() -> None:
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    for shape in ((1, 40), (BLOCK, 40), (BLOCK + 1, 40), (3, 70, 40), (0, 40)):
        x = torch.randn(*shape, generator=g)
        ours, theirs = linear_rows(x, w, b), F.linear(x, w, b)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)


class _Layer(torch.nn.Module):
    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k).bfloat16(), requires_grad=False)


def test_upstream_linear_method_through_the_patch() -> None:
    """Upstream's UnquantizedLinearMethod, wrapped as the patch wraps it: its rows are the
    rows computed alone; a layer with packed AMX weights keeps upstream's path."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    method, layer = UnquantizedLinearMethod(), _Layer(256, 128)
    x = torch.randn(47, 128).bfloat16()
    apply, into = UnquantizedLinearMethod.apply, UnquantizedLinearMethod.apply_into
    apply = getattr(apply, "__wrapped__", apply)
    into = getattr(into, "__wrapped__", into)
    alone = torch.cat([linear_apply(apply, method, layer, x[i : i + 1]) for i in range(47)])
    assert torch.equal(linear_apply(apply, method, layer, x), alone)
    out = torch.empty(47, 256, dtype=torch.bfloat16)
    assert linear_apply_into(into, method, layer, x, out) is out and torch.equal(out, alone)
    layer.use_intel_amx_backend = True
    calls = []
    linear_apply(lambda *a: calls.append(a) or a[2], method, layer, x)
    assert len(calls) == 1


def test_lm_head_plain_branch_and_others() -> None:
    """The plain lm_head (upstream's unquantized embedding method) is row-invariant; a
    LoRA-wrapped head or the fp32 option keeps upstream's branch."""
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    head = _Layer(1050, 64)
    head.quant_method = UnquantizedEmbeddingMethod()
    proc = LogitsProcessor.__new__(LogitsProcessor)  # only the attributes the branch reads
    proc.use_fp32_lm_head, proc.rl_on_policy_target = False, None
    calls = []

    def original(*args, **kwargs):
        calls.append(args)
        return None

    h = torch.randn(5, 64).bfloat16()
    alone = torch.cat([compute_lm_head(original, proc, h[i : i + 1], head) for i in range(5)])
    assert torch.equal(compute_lm_head(original, proc, h, head), alone) and not calls
    proc.use_fp32_lm_head = True
    compute_lm_head(original, proc, h, head)
    proc.use_fp32_lm_head = False
    head.set_lora, head.apply_lora = object(), object()
    compute_lm_head(original, proc, h, head)
    assert len(calls) == 2
