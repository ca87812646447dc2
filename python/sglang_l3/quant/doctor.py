"""`sglang-l3 doctor` section for GPTQ on ROCm: which kernel would serve which
(bits, zero format, dtype) on this machine, and why the others would not.

The table is the dispatcher's own eligibility logic on a typical layer (group
128, symmetric, no act-order, 4096x4096); the real choice is made per layer at
load time after the self-check, and those decisions are listed when this runs
inside a serving process.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sglang_l3.quant.gptq_ref import ZeroFormat

FORMATS: tuple[ZeroFormat, ...] = ("v1", "v2")
BITS = (2, 3, 4, 8)
DTYPES = (torch.float16, torch.bfloat16)


def _short(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def report(dev: Any | None = None) -> dict:
    """{"ok": bool, "lines": [...], "data": {...}}. `dev` (a dispatch.DeviceInfo)
    overrides the detected device (tests simulate gfx1100 with it)."""
    from sglang_l3.quant.platform import not_applicable_reason

    reason = not_applicable_reason() if dev is None else None
    if reason:
        return {
            "ok": True,
            "lines": [f"gptq-rocm: not applicable here ({reason})"],
            "data": {"applicable": False, "reason": reason},
        }

    from sglang_l3.quant import dispatch

    if dev is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        dev = dispatch.device_info(device)
    found = dispatch.installed()
    kernels = dispatch.candidates(found)
    lines = [
        f"gptq-rocm: device {dev.arch or dev.type}; kernels in dispatch order: " + ", ".join(k.name for k in kernels)
    ]
    if os.environ.get(dispatch.ENV_OPS):
        lines.append(f"  {dispatch.ENV_OPS}={os.environ[dispatch.ENV_OPS]}")
    lines += [f"  probe: {n}" for n in found.notes]
    table: list[dict[str, Any]] = []
    ok = True
    for bits in BITS:
        for fmt in FORMATS:
            for dtype in DTYPES:
                plan = dispatch.plan(bits, fmt, dtype, dev, kernels=kernels)
                chosen = next((k for k, why in plan if why is None), None)
                skipped = [(k, why) for k, why in plan if why is not None]
                table.append(
                    {"bits": bits, "format": fmt, "dtype": _short(dtype), "kernel": chosen, "skipped": skipped}
                )
                why_not = "; ".join(f"{k}: {w}" for k, w in skipped) or "first choice"
                lines.append(f"  {bits}-bit {fmt} {_short(dtype)}: {chosen}  ({why_not})")
                ok = ok and chosen is not None
    made = dispatch.decisions()
    failed_checks = [d for d in made if any("self-check" in r for _, r in d["skipped"])]
    if made:
        lines.append(
            f"  this process: {len(made)} GPTQ layers loaded, {len(failed_checks)} fell back after a failed self-check"
        )
        for d in failed_checks:
            lines.append(f"    {d['prefix']}: now {d['kernel']}; " + "; ".join(f"{k}: {r}" for k, r in d["skipped"]))
    return {
        "ok": ok and not failed_checks,
        "lines": lines,
        "data": {
            "applicable": True,
            "arch": dev.arch,
            "device": dev.type,
            "kernels": [k.name for k in kernels],
            "probe_notes": list(found.notes),
            "table": table,
            "decisions": made,
        },
    }
