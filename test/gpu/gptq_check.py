"""The compiled GPTQ Triton kernel against the torch reference, on a GPU, with
nothing but torch + triton (no sglang, no pytest): what test/gpu/device_check.sh
runs on a lent GPU machine.

  python test/gpu/gptq_check.py [--json out.json] [--deadline-s 180] [--dry-run]

Every case compares the kernel with the fp32 reference (gptq_ref.compare: a few
roundings of the output dtype) and, as its negative control, checks that the
other zero format does NOT match. --dry-run (no GPU needed) builds the same
layers on the CPU and checks the harness against the reference dequantize
path only; it never launches the kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import torch  # noqa: E402
from sglang_l3.quant import gptq_ref as R  # noqa: E402

K, N = 512, 320  # N not a multiple of the kernel's BN=64
MS = (1, 16, 40, 130)
F16, BF16 = torch.float16, torch.bfloat16
# every 4-bit variant (the RDNA3 production case), then the other widths
CASES = [
    (4, gs, act, sym, fmt, dt)
    for gs, act in ((128, False), (64, True), (-1, False))
    for sym in (True, False)
    for fmt in ("v1", "v2")
    for dt in (F16, BF16)
] + [(bits, 128, False, True, "v1", dt) for bits in (2, 3, 8) for dt in (F16, BF16)]


def _layer(bits: int, gs: int, act: bool, sym: bool, fmt: str, dtype: torch.dtype, dev: str):
    g = torch.Generator().manual_seed(bits * 1000 + gs)
    L = R.quantize(
        torch.randn(K, N, generator=g) * 0.05, bits, gs, sym=sym, act_order=act, fmt=fmt, scale_dtype=dtype, seed=bits
    )
    for f in ("qweight", "qzeros", "scales", "g_idx", "w"):
        setattr(L, f, getattr(L, f).to(dev))
    return L


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--deadline-s", type=float, default=180.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.dry_run:
        dev = "cpu"
    elif torch.cuda.is_available():
        dev = "cuda"
    else:
        print("gptq_check: no GPU visible to torch; use --dry-run to check the harness")
        return 2
    if not args.dry_run:
        from sglang_l3.quant.gptq_triton import gptq_gemm

        print(
            f"gptq_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"triton {__import__('triton').__version__}"
        )
    cases, ms = (CASES[::5], MS[:2]) if args.dry_run else (CASES, MS)
    rows, failed, done = [], 0, 0
    for bits, gs, act, sym, fmt, dtype in cases:
        if time.monotonic() - t0 > args.deadline_s:
            print(f"gptq_check: deadline reached after {done}/{len(cases)} cases")
            break
        name = f"b{bits}-g{gs}{'-act' if act else ''}-{'sym' if sym else 'asym'}-{fmt}-{str(dtype)[6:]}"
        L = _layer(bits, gs, act, sym, fmt, dtype, dev)
        other = "v2" if fmt == "v1" else "v1"
        for m in ms:
            x = R.check_inputs(m, K, dtype, dev, seed=m)
            ref = x.float() @ L.w
            if args.dry_run:  # the reference path only: dequantize == the layer's weights
                w = R.dequantize(L.qweight, L.qzeros, L.scales, L.g_idx, bits, fmt)
                c = R.compare((x.float() @ w).to(dtype), ref, dtype)
                neg_ok = True
            else:
                gidx = L.g_idx if act else None
                c = R.compare(gptq_gemm(x, L.qweight, L.qzeros, L.scales, gidx, bits, gs, fmt), ref, dtype)
                bad = gptq_gemm(x, L.qweight, L.qzeros, L.scales, gidx, bits, gs, other)
                neg_ok = not R.compare(bad, ref, dtype).ok
            ok = c.ok and neg_ok
            failed += not ok
            rows.append(
                {
                    "case": name,
                    "m": m,
                    "ok": ok,
                    "rel_l2": c.rel_l2,
                    "max_rel": c.max_rel,
                    "wrong_format_caught": neg_ok,
                }
            )
            if not ok:
                print(f"  MISMATCH {name} M={m}: {c}; wrong format caught: {neg_ok}")
        done += 1
    worst = max((r["rel_l2"] for r in rows), default=0.0)
    print(
        f"gptq_check ({'dry run, reference path' if args.dry_run else 'compiled Triton kernel'}): "
        f"{done}/{len(cases)} cases x {len(ms)} M, {len(rows) - failed}/{len(rows)} match, "
        f"worst rel_l2 {worst:.3g}, {time.monotonic() - t0:.1f} s"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": dev, "cases": len(cases), "done": done, "failed": failed, "rows": rows}, indent=1)
        )
    return 1 if failed or done == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
