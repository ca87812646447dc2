"""Patch group `cpu-serving` (why: patches/series.toml, one entry per id):
`python -m sglang.launch_server --device cpu` serves the packaged tiny Qwen3-Next
(Gated-DeltaNet hybrid) on a host with no accelerator.

One module, several series entries (each with its own kind and targets);
`apply(ctx)` dispatches on `ctx.id`. Every entry applies only when asked
(SGLANG_L3_CPU_SERVING=1 or sglang_l3.cpu.enable(): the demo, the tests, the CPU
server launcher) and never next to an accelerator; cpu-gdn-torch `requires` the
host-pool shims (patch cpu-host-pools), which the queue applies first.

How, per entry:
- cpu-gdn-torch: the Triton GDN kernels, causal conv1d and extra_buffer track
  copies are replaced by the torch ports in sglang_l3.cpu_serving.
- cpu-qwen3next-ops: the Triton qkvzba split and the gated RMSNorm forward are
  replaced by torch versions (sglang_l3.cpu_serving.ops).
- cpu-qwen35-ops: Qwen3.5's Triton contiguous qkvzba split, the gated RMSNorm
  forward (fla.layernorm_gated.RMSNorm) and the attention output gate
  (fused_sigmoid_mul, strided 3-D gate) are replaced by torch versions.
- cpu-moe-gate: the Triton shared-expert gate (fused_gate_sigmoid_mul[_add]) is
  replaced by a torch version.
- cpu-device-module: AROUND Qwen3GatedDeltaNet.__init__, torch.get_device_module()
  with no argument returns torch.cpu.
- cpu-rope-native: AROUND RotaryEmbedding.__init__, the module flag _is_mps is
  True, so no vllm "fallback kernel" is imported.
- cpu-extra-buffer: the platform check for --mamba-radix-cache-strategy
  extra_buffer returns True.
- cpu-pin-memory: Tensor.pin_memory returns the tensor itself.
- cpu-attention-invariant: AROUND the torch_native backend's extend SDPA, causal
  self-attention runs in query blocks fixed in absolute positions
  (sglang_l3.cpu_serving.attention): a token's output does not depend on where its
  prefill chunk starts or ends, so cached and uncached prefills agree bit for bit.
- cpu-tp-gloo: AROUND GroupCoordinator.__init__, the device communicators
  (PyNccl and friends) stay off when the group's backend is gloo, so `--tp-size 2`
  reduces CPU tensors with torch.distributed on the gloo group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from sglang_l3.patches.framework import PatchContext

_GDN = "sglang.srt.layers.attention.linear.gdn_backend"
_HLAB = "sglang.srt.layers.attention.hybrid_linear_attn_backend"
_QWEN3_NEXT = "sglang.srt.models.qwen3_next"
_QWEN3_5 = "sglang.srt.models.qwen3_5"


def applicable() -> str | None:
    from sglang_l3.cpu import not_applicable_reason

    return not_applicable_reason()


def apply(ctx: PatchContext) -> None:
    _APPLY[ctx.id](ctx)


# --------------------------------------------------------------------------- #
def _gdn_torch(ctx: PatchContext) -> None:
    from sglang_l3.cpu_serving import conv1d, gdn, ops

    ctx.replace(f"{_GDN}:TritonGDNKernel", gdn.make_kernel_class())
    ctx.replace(f"{_GDN}:fused_gdn_gating", gdn.gdn_gating)
    ctx.replace(f"{_GDN}:causal_conv1d_fn", conv1d.causal_conv1d_fn)
    ctx.replace(f"{_GDN}:causal_conv1d_update", conv1d.causal_conv1d_update)
    ctx.replace(f"{_HLAB}:track_mamba_states_if_needed", ops.track_mamba_states_if_needed)
    ctx.replace(f"{_HLAB}:track_mamba_states_all_layers", ops.track_mamba_states_all_layers)


def _qwen3next_ops(ctx: PatchContext) -> None:
    from sglang_l3.cpu_serving import ops

    ctx.replace(f"{_QWEN3_NEXT}:fused_qkvzba_split_reshape_cat", ops.fused_qkvzba_split_reshape_cat)

    def fused_rms_norm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None or prenorm:
            raise NotImplementedError("sglang-l3 CPU FusedRMSNormGated: residual/prenorm")
        return ops.rms_norm_gated(x, g, self.weight, self.bias, self.activation, self.eps)

    ctx.replace(
        "sglang.kernels.ops.attention.fla.fused_norm_gate:FusedRMSNormGated.forward",
        fused_rms_norm_gated_forward,
    )


def _qwen35_ops(ctx: PatchContext) -> None:
    from sglang_l3.cpu_serving import ops

    # the names qwen3_5.py bound at import (the GDN backend binds its own copy of
    # the split only on CUDA/HIP/XPU)
    ctx.replace(f"{_QWEN3_5}:fused_qkvzba_split_reshape_cat_contiguous", ops.fused_qkvzba_split_reshape_cat_contiguous)
    ctx.replace(f"{_QWEN3_5}:fused_sigmoid_mul", ops.fused_sigmoid_mul)

    def rms_norm_gated_forward(self, x, z=None):
        return ops.layernorm_gated_rms(
            x, self.weight, self.bias, z, self.eps, self.group_size, self.norm_before_gate, self.activation
        )

    ctx.replace("sglang.kernels.ops.attention.fla.layernorm_gated:RMSNorm.forward", rms_norm_gated_forward)


@contextlib.contextmanager
def _cpu_device_module():
    """torch.get_device_module() (no argument) -> torch.cpu, for the duration."""
    import torch

    original = torch.get_device_module

    def get_device_module(device=None):
        return torch.cpu if device is None else original(device)

    torch.get_device_module = get_device_module
    try:
        yield
    finally:
        torch.get_device_module = original


def _moe_gate(ctx: PatchContext) -> None:
    from sglang_l3.cpu_serving import ops

    ctx.replace("sglang.srt.models.qwen2_moe:fused_gate_sigmoid_mul", ops.fused_gate_sigmoid_mul)
    ctx.replace("sglang.srt.models.qwen2_moe:fused_gate_sigmoid_mul_add", ops.fused_gate_sigmoid_mul_add)


def _device_module(ctx: PatchContext) -> None:
    def init(original: Callable, *args: Any, **kwargs: Any) -> Any:
        with _cpu_device_module():
            return original(*args, **kwargs)

    ctx.around(f"{_QWEN3_NEXT}:Qwen3GatedDeltaNet.__init__", init)


def _rope_native(ctx: PatchContext) -> None:
    from sglang.srt.layers.rotary_embedding import base

    def init(original: Callable, *args: Any, **kwargs: Any) -> Any:
        previous = base._is_mps
        base._is_mps = True  # the only reader is this __init__
        try:
            return original(*args, **kwargs)
        finally:
            base._is_mps = previous

    ctx.around("sglang.srt.layers.rotary_embedding.base:RotaryEmbedding.__init__", init)


def _extra_buffer(ctx: PatchContext) -> None:
    ctx.replace(
        "sglang.srt.arg_groups.mamba_hook:_platform_supports_mamba_cache_extra_buffer",
        lambda: True,
    )


def _pin_memory(ctx: PatchContext) -> None:
    def pin_memory(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
        # No accelerator (applicable() checked): pinning can only fail; a pageable
        # tensor is what every caller gets from .to("cpu", non_blocking=True) anyway.
        return self

    ctx.around("torch:Tensor.pin_memory", pin_memory)


def _tp_gloo(ctx: PatchContext) -> None:
    import inspect

    from sglang.srt.distributed import parallel_state

    # the device communicators a gloo (CPU) group cannot build or use
    off = ("use_pynccl", "use_mscclpp", "use_custom_allreduce", "use_torch_symm_mem_all_reduce")

    def init(original: Callable, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(original).bind(*args, **kwargs)
        if str(bound.arguments.get("torch_distributed_backend")) == "gloo":
            for name in off:
                if bound.arguments.get(name):
                    bound.arguments[name] = False
        return original(*bound.args, **bound.kwargs)

    del parallel_state  # imported to fail early if the module moved
    ctx.around("sglang.srt.distributed.parallel_state:GroupCoordinator.__init__", init)


def _attention_invariant(ctx: PatchContext) -> None:
    from sglang_l3.cpu_serving.attention import sdpa_forward_extend

    ctx.around(
        "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend._run_sdpa_forward_extend",
        sdpa_forward_extend,
    )


def _linear_invariant(ctx: PatchContext) -> None:
    from sglang_l3.cpu_serving.linear import compute_lm_head, linear_apply, linear_apply_into, moe_forward_native

    method = "sglang.srt.layers.quantization.unquant:UnquantizedLinearMethod"
    ctx.around(f"{method}.apply", linear_apply)
    ctx.around(f"{method}.apply_into", linear_apply_into)
    ctx.around("sglang.srt.layers.logits_processor:LogitsProcessor._compute_lm_head", compute_lm_head)
    ctx.around("sglang.srt.layers.moe.fused_moe_native:moe_forward_native", moe_forward_native)


_APPLY: dict[str, Callable[[PatchContext], None]] = {
    "cpu-gdn-torch": _gdn_torch,
    "cpu-qwen3next-ops": _qwen3next_ops,
    "cpu-qwen35-ops": _qwen35_ops,
    "cpu-moe-gate": _moe_gate,
    "cpu-device-module": _device_module,
    "cpu-rope-native": _rope_native,
    "cpu-extra-buffer": _extra_buffer,
    "cpu-pin-memory": _pin_memory,
    "cpu-tp-gloo": _tp_gloo,
    "cpu-attention-invariant": _attention_invariant,
    "cpu-linear-invariant": _linear_invariant,
}
