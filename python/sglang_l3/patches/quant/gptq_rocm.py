"""Patch `gptq-rocm` (why: patches/series.toml): `--quantization gptq` on ROCm (RDNA3 first).

How: QUANTIZATION_METHODS["gptq"] = sglang_l3.quant.rocm_gptq.RocmGPTQConfig (edited
in place, refused when upstream registers one); AROUND
ModelConfig._verify_quantization only upstream's exact ROCm refusal of gptq becomes
acceptance; AROUND GPTQMarlinConfig.override_quantization_method a GPTQ checkpoint
is not upgraded to Marlin on HIP unless asked; sglang_l3.quant.rocm_gptq supplies
the linear kernel that GPTQLinearScheme._init_kernel refuses to pick.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_l3.patches.framework import PatchContext, PatchError
from sglang_l3.quant.platform import not_applicable_reason, on_hip

logger = logging.getLogger("sglang_l3.patches.gptq_rocm")

REGISTRY = "sglang.srt.layers.quantization:get_quantization_config"
ALLOWLIST = "sglang.srt.configs.model_config:ModelConfig._verify_quantization"
MARLIN = "sglang.srt.layers.quantization.gptq.gptq:GPTQMarlinConfig.override_quantization_method"
# the exact error the allowlist raises (ModelConfig._verify_quantization)
ROCM_REJECT = "gptq quantization is currently not supported in ROCm."


def _on_hip() -> bool:
    return on_hip()


def applicable() -> str | None:
    return not_applicable_reason()


def apply(ctx: PatchContext) -> None:
    from sglang.srt.layers import quantization as q

    from sglang_l3.quant.rocm_gptq import RocmGPTQConfig

    # 1. Registry: edit the dict in place (sglang.srt.configs.model_config imported this very
    #    object; rebinding the name would leave that reference stale).
    registry = q.QUANTIZATION_METHODS
    if "gptq" in registry:
        raise PatchError(
            f"anchor changed: upstream now registers 'gptq' on this platform "
            f"({registry['gptq'].__name__}); re-verify whether gptq-rocm is still needed"
        )
    registry["gptq"] = RocmGPTQConfig
    ctx.on_undo(lambda: registry.pop("gptq", None))
    ctx.fired("register_gptq")

    # 2. Allowlist: upstream is the reference; only its exact ROCm rejection of
    #    gptq is turned into acceptance. Everything after that raise is a warning.
    def verify_quantization(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except ValueError as e:
            if (
                str(e) == ROCM_REJECT
                and self.quantization == "gptq"
                and _on_hip()
                and registry.get("gptq") is RocmGPTQConfig
            ):
                ctx.fired("rocm_allowlist_gptq")
                logger.info("sglang-l3: gptq accepted on ROCm (kernels: sglang_l3.quant)")
                return None
            raise

    ctx.around(ALLOWLIST, verify_quantization)

    # 3. No automatic Marlin upgrade on HIP: Marlin is CUDA-only. An explicit
    #    --quantization gptq_marlin still goes to upstream, whose ROCm allowlist
    #    then refuses it with its own clear message.
    def no_marlin_on_hip(original: Any, cls: Any, hf_quant_cfg: Any, user_quant: Any) -> Any:
        if user_quant is None and _on_hip():
            ctx.fired("marlin_upgrade_blocked")
            return None
        return original(cls, hf_quant_cfg, user_quant)

    ctx.around(MARLIN, no_marlin_on_hip)
