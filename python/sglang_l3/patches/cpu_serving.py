"""Patch group `cpu-serving`: `python -m sglang.launch_server --device cpu` serves
the packaged tiny Qwen3-Next (Gated-DeltaNet hybrid) on a host with no accelerator.

One module, several series entries (each with its own kind and targets);
`apply(ctx)` dispatches on `ctx.id`. Every entry is "not applicable" when an
accelerator is present, so a GPU server is never touched. In a process that
does not serve (a test calling apply_all() and driving the cache stack itself)
the entries are inert: they replace kernels that cannot run on such a host
anyway, and the hooks only act inside the constructors they wrap.

Upstream defects worked around (sglang 0.5.23, no accelerator, no sgl-kernel CPU build):

- cpu-gdn-torch: the GDN backend binds Triton kernels at import
  (layers/attention/linear/gdn_backend.py:6-15: fused_gdn_gating,
  causal_conv1d_fn/update, TritonGDNKernel -> FLA chunk_gated_delta_rule /
  fused_sigmoid_gating_delta_rule_update, kernels/gdn_triton.py:8-18), and the
  extra_buffer track copies are Triton (hybrid_linear_attn_backend.py:12-17).
  Triton kernels do not run on a CPU tensor (only under TRITON_INTERPRET=1, slow,
  and bf16 tl.dot is wrong there); the in-tree CPU alternative (is_cpu(),
  SGLANG_USE_CPU_ENGINE=1) needs sgl-kernel CPU ops that are not on PyPI.
  Replaced by the torch ports in sglang_l3.cpu_serving. Also enables the
  HiCache host-pool CPU shims (sglang_l3.cpu.enable(), patch cpu-host-pools).
- cpu-qwen3next-ops: models/qwen3_next.py:12 binds the Triton
  fused_qkvzba_split_reshape_cat (used at :455 unless is_cpu()), and the GDN
  output norm FusedRMSNormGated.forward (fla/fused_norm_gate.py:435) calls the
  Triton rms_norm_gated.
- cpu-moe-gate: every Qwen3-Next layer is a sparse MoE block in 0.5.23
  (qwen3_next.py:543, :703; mlp_only_layers is ignored); its shared-expert gate
  binds the Triton fused_gate_sigmoid_mul[_add] (models/qwen2_moe.py:31-32,
  used at :731, :877). The routed experts already run torch-native on CPU.
- cpu-device-module: Qwen3GatedDeltaNet.__init__ (qwen3_next.py:235, :252) calls
  torch.get_device_module().current_device(), which raises without an accelerator.
- cpu-rope-native: RotaryEmbedding.__init__ (rotary_embedding/base.py:122-141)
  imports vllm._custom_ops.rotary_embedding as a "fallback kernel" on any
  platform it does not know; the module flag _is_mps (read only there, :128)
  keeps it on the torch path.
- cpu-extra-buffer: _platform_supports_mamba_cache_extra_buffer
  (arg_groups/mamba_hook.py:102) allows --mamba-radix-cache-strategy
  extra_buffer only on CUDA/MUSA/NPU/HIP/XPU; the torch GDN kernel returns the
  per-chunk states `h` that strategy needs.
- cpu-pin-memory: ScheduleBatch.prepare_for_decode (schedule_batch.py:3830)
  pins the extra_buffer track mask unconditionally; pinning needs a driver.
- cpu-tp-gloo: `--tp-size 2` on CPU. GroupCoordinator.__init__
  (distributed/parallel_state.py:295) builds PyNcclCommunicator(device=cpu)
  (:463-468) -> "ValueError: Expected a cuda device, but got: cpu"
  (pynccl.py:116), because init_model_parallel_group (:2160, :2180-2185) turns
  PyNccl on for every in-tree platform but NPU/XPU. With the gloo backend the
  device communicators are off; CPU tensors are reduced/gathered with
  torch.distributed on the gloo device group (:695-700, :1425-1429) anyway.
  (The other TP=2 stop, numa_utils.init_threads_binding's "ranks <= NUMA
  nodes" assert, is an environment setting: SGLANG_CPU_OMP_THREADS_BIND.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from sglang_l3.patches.framework import PatchContext

_GDN = "sglang.srt.layers.attention.linear.gdn_backend"
_HLAB = "sglang.srt.layers.attention.hybrid_linear_attn_backend"
_QWEN3_NEXT = "sglang.srt.models.qwen3_next"


def applicable() -> str | None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        return "an accelerator is present"
    return None


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
    # A CPU server needs the HiCache host pools to work without a driver too.
    import sglang_l3.cpu

    sglang_l3.cpu.enable()


def _qwen3next_ops(ctx: PatchContext) -> None:
    from sglang_l3.cpu_serving import ops

    ctx.replace(f"{_QWEN3_NEXT}:fused_qkvzba_split_reshape_cat", ops.fused_qkvzba_split_reshape_cat)

    def fused_rms_norm_gated_forward(self, x, g, residual=None, prenorm=False,
                                     residual_in_fp32=False):
        if residual is not None or prenorm:
            raise NotImplementedError("sglang-l3 CPU FusedRMSNormGated: residual/prenorm")
        return ops.rms_norm_gated(x, g, self.weight, self.bias, self.activation, self.eps)

    ctx.replace(
        "sglang.kernels.ops.attention.fla.fused_norm_gate:FusedRMSNormGated.forward",
        fused_rms_norm_gated_forward,
    )


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
    ctx.replace("sglang.srt.models.qwen2_moe:fused_gate_sigmoid_mul_add",
                ops.fused_gate_sigmoid_mul_add)


def _device_module(ctx: PatchContext) -> None:
    def init(original: Callable, *args: Any, **kwargs: Any) -> Any:
        with _cpu_device_module():
            return original(*args, **kwargs)

    ctx.around(f"{_QWEN3_NEXT}:Qwen3GatedDeltaNet.__init__", init)


def _rope_native(ctx: PatchContext) -> None:
    from sglang.srt.layers.rotary_embedding import base

    def init(original: Callable, *args: Any, **kwargs: Any) -> Any:
        previous = base._is_mps
        base._is_mps = True  # the only reader is this __init__ (base.py:128)
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


_APPLY: dict[str, Callable[[PatchContext], None]] = {
    "cpu-gdn-torch": _gdn_torch,
    "cpu-qwen3next-ops": _qwen3next_ops,
    "cpu-moe-gate": _moe_gate,
    "cpu-device-module": _device_module,
    "cpu-rope-native": _rope_native,
    "cpu-extra-buffer": _extra_buffer,
    "cpu-pin-memory": _pin_memory,
    "cpu-tp-gloo": _tp_gloo,
}
