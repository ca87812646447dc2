"""Where GPTQ-on-ROCm applies: shared by the `gptq-rocm` patch and the doctor
section (which must not import patches/)."""

from __future__ import annotations


def on_hip() -> bool:
    from sglang.srt import utils  # looked up per call: tests simulate HIP by patching it

    return bool(utils.is_hip())


def not_applicable_reason() -> str | None:
    """None where the patch applies, else why not."""
    if not on_hip():
        return "not ROCm (torch.version.hip is None)"
    from sglang.srt import utils

    if utils.is_cpu():
        return "SGLang CPU engine selected (SGLANG_USE_CPU_ENGINE=1)"
    return None
