"""GPTQ config + linear scheme for ROCm, built on upstream's GPTQ classes.

Upstream 0.5.23 keeps the GPTQ config, the GPTQLinearMethod and the scheme's
weight creation, but `GPTQLinearScheme._init_kernel` raises
(GPTQLinearScheme._init_kernel). We reuse all of it and
supply the kernel: `_init_kernel` returns a `_DispatchedKernel`, which after the
weights load detects the zero format, sorts act-order rows, and lets
`dispatch.select` pick and verify the GEMM.

Also fixed here, without touching upstream:
  * fp16 and bf16 activations (GPTQConfig.get_supported_act_dtypes says fp16 only);
  * pack_factor is derived from weight_bits (override_config in
    quantization.utils.override_config assigns 32 // bits: 10 instead of 32/3);
  * MoE layers go to upstream's moe_wna16 method when its constraints hold.
"""

from __future__ import annotations

import logging
from fractions import Fraction
from typing import Any, cast

import torch
from sglang.srt.layers.quantization.gptq import GPTQConfig, GPTQLinearMethod
from sglang.srt.layers.quantization.gptq.schemes import GPTQLinearScheme
from sglang.srt.layers.quantization.utils import get_linear_quant_method

from sglang_l3.quant import dispatch
from sglang_l3.quant.gptq_ref import ZeroFormat

logger = logging.getLogger("sglang_l3.quant")

_CONFIG_KEYS_NOT_COPIED = ("hf_config", "packed_modules_mapping")


class RocmGPTQConfig(GPTQConfig):
    """`--quantization gptq` on ROCm."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.is_sym: bool | None = None
        self.full_config: dict[str, Any] = {}

    # override_config() assigns `32 // bits` to this attribute for every layer it
    # clones; 3-bit needs Fraction(32, 3), so the value always follows weight_bits.
    @property
    def pack_factor(self) -> Fraction:
        return Fraction(32, self.weight_bits)

    @pack_factor.setter
    def pack_factor(self, _value: Any) -> None:
        pass

    @property
    def declared_format(self) -> ZeroFormat:
        return "v2" if self.checkpoint_format == "gptq_v2" else "v1"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.half, torch.bfloat16]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RocmGPTQConfig:
        cfg = super().from_config(config)
        assert isinstance(cfg, RocmGPTQConfig)
        cfg.is_sym = config.get("sym")
        # kept for the moe_wna16 delegation; the HF config object is not needed
        # there and would be deep-copied with every linear layer's config.
        cfg.full_config = {k: v for k, v in config.items() if k not in _CONFIG_KEYS_NOT_COPIED}
        return cfg

    def __repr__(self) -> str:
        return "Rocm" + super().__repr__()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

        if isinstance(layer, FusedMoE):
            return moe_method(self, layer, prefix)
        method = get_linear_quant_method(self, layer, prefix=prefix, linear_method_cls=GPTQLinearMethod)
        if isinstance(method, GPTQLinearMethod):
            # attached eagerly (LinearBase.scheme contract) so the layer's name
            # reaches the kernel choice and its log lines
            layer.scheme = RocmGPTQLinearScheme(method.quant_config, prefix=prefix)
        return method

    def get_linear_scheme(self, layer: torch.nn.Module):
        return RocmGPTQLinearScheme(self)

    def get_moe_scheme(self, layer: torch.nn.Module):
        raise NotImplementedError("ROCm GPTQ MoE layers use the moe_wna16 method")


# --------------------------------------------------------------------------- #
# MoE: delegate to upstream's moe_wna16 (Triton fused MoE, works on ROCm)
# --------------------------------------------------------------------------- #
def moe_wna16_unsupported(cfg: RocmGPTQConfig, hidden: int | None, inter: int | None) -> str | None:
    """Why moe_wna16 cannot run this GPTQ MoE layer correctly (None: it can)."""
    if cfg.weight_bits not in (4, 8):
        return f"bits={cfg.weight_bits} (moe_wna16 supports 4 and 8)"
    if cfg.group_size <= 0:
        return "channel-wise group_size=-1 (moe_wna16 needs groups)"
    if cfg.desc_act:
        return "desc_act=True (moe_wna16 ignores g_idx)"
    if cfg.is_sym is None:
        return "quantize config lacks 'sym'"
    if not cfg.is_sym and cfg.declared_format != "v1":
        # its loader adds 1 to GPTQ zeros (v1); symmetric layers ignore zeros
        return "asymmetric gptq_v2 zeros (moe_wna16 assumes v1)"
    if hidden is not None and inter is not None:
        gs = cfg.group_size
        while inter % gs or hidden % gs:  # moe_wna16 halves the group to fit, down to 32
            gs //= 2
            if gs < 32:
                return f"hidden={hidden}/intermediate={inter} not divisible by a group >= 32"
    return None


def moe_method(cfg: RocmGPTQConfig, layer: torch.nn.Module, prefix: str):
    from sglang.srt.layers.quantization.moe_wna16 import MoeWNA16Config, MoeWNA16Method

    why = moe_wna16_unsupported(
        cfg, getattr(layer, "hidden_size", None), getattr(layer, "intermediate_size_per_partition", None)
    )
    if why:
        raise ValueError(
            f"GPTQ MoE layer {prefix!r} on ROCm: the moe_wna16 path cannot serve it: {why}. "
            "No other GPTQ MoE kernel exists on ROCm in this build."
        )
    wna16 = MoeWNA16Config.from_config({**cfg.full_config, "quant_method": "gptq"})
    dispatch.record_decision(
        {
            "prefix": prefix,
            "bits": cfg.weight_bits,
            "fmt": cfg.declared_format,
            "dtype": "moe",
            "group_size": cfg.group_size,
            "act_order": False,
            "kernel": "moe_wna16 (upstream Triton fused MoE)",
            "fmt_reason": "declared",
            "check": "",
            "skipped": [],
        }
    )
    return MoeWNA16Method(wna16)


# --------------------------------------------------------------------------- #
# Linear scheme
# --------------------------------------------------------------------------- #
class RocmGPTQLinearScheme(GPTQLinearScheme):
    """Upstream's GPTQ weight creation; our kernel choice after loading."""

    requires_weight_loader_v2 = True

    def __init__(self, quant_config: GPTQConfig, prefix: str = "") -> None:
        self.prefix = prefix
        super().__init__(quant_config)

    def _init_kernel(self, quant_config: GPTQConfig) -> _DispatchedKernel:
        return _DispatchedKernel(quant_config, self)


class _DispatchedKernel:
    """The `kernel` object upstream's GPTQLinearScheme delegates to."""

    use_shuffle = True  # set by upstream create_weights; our layout is chosen per kernel

    def __init__(self, quant_config: GPTQConfig, scheme: RocmGPTQLinearScheme) -> None:
        self.config = quant_config
        self.scheme = scheme
        self.selection: dispatch.Selection | None = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        cfg = self.config
        declared: ZeroFormat = "v2" if cfg.checkpoint_format == "gptq_v2" else "v1"
        # upstream's create_weights registered these; torch types a module attribute Tensor | Module
        ck = dispatch.Checkpoint(
            qweight=cast(torch.Tensor, layer.qweight.data),
            qzeros=cast(torch.Tensor, layer.qzeros.data),
            scales=cast(torch.Tensor, layer.scales.data),
            g_idx=cast(torch.Tensor, layer.g_idx.data) if getattr(layer, "g_idx", None) is not None else None,
        )
        dtype = getattr(layer, "params_dtype", None) or ck.scales.dtype
        sel = dispatch.select(
            ck,
            bits=cfg.weight_bits,
            group_size=cfg.group_size,
            desc_act=cfg.desc_act,
            declared=declared,
            dtype=dtype,
            prefix=self.scheme.prefix,
        )
        self.selection = sel
        logger.info(
            "sglang-l3 GPTQ %s: %s (bits=%d fmt=%s dtype=%s group=%d%s; %s)",
            self.scheme.prefix or "<layer>",
            sel.kernel,
            cfg.weight_bits,
            sel.fmt,
            dtype,
            cfg.group_size,
            " act-order" if sel.act_order else "",
            sel.fmt_reason,
        )
        # The kernel reads its own (sorted / shuffled) copies; the parameters are
        # re-pointed at them so the checkpoint layout is freed, not kept twice.
        for name, t in sel.tensors.items():
            layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.selection is None:
            raise RuntimeError(f"GPTQ layer {self.scheme.prefix!r} used before its weights were processed")
        out = self.selection.gemm(x)
        if bias is not None:
            out.add_(bias)
        return out
