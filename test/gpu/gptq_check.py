"""The GPTQ Triton kernels against the torch reference, with nothing but torch +
triton (no sglang, no pytest): what test/gpu/device_check.sh runs on a lent GPU.

  python test/gpu/gptq_check.py [--json out.json] [--deadline-s 180] [--dry-run]

1. cases: every 4-bit variant (groups, act-order, symmetric or not, v1/v2 zeros,
   fp16/bf16) and 2/3/8-bit, each at M = 1, 2, 3 (the GEMV kernel holding 1, 2, 4
   rows), 8, 16 (tl.dot split over K), 40, 130 (tl.dot tiles), launched as the
   dispatcher does (the launch shape picked from this device's table by M); each
   with its wrong-zero-format negative control.
2. table configs: every decode config of every architecture table
   (gptq_triton.ARCH_TABLES: GEMV at 1, 2, 4 rows, split-K tl.dot), forced onto
   two 4-bit layers (grouped fp16; act-order bf16), split over K in 2 and unsplit;
   this device's table also on 2/3/8-bit layers.
Every result is compared with the fp32 reference (gptq_ref.compare: a few
roundings of the output dtype).

--dry-run (no GPU needed): the same checks on the CPU under the Triton
interpreter (TRITON_INTERPRET=1, set here before triton is imported), at a
smaller layer, a fifth of the cases, M = 1, 3, 8, 19 and the table configs on the
two 4-bit layers; exit 3, saying why, where that interpreter cannot run the kernels
(sglang_l3.testing.triton_probe: Triton 3.6's with NumPy >= 2.4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import torch  # noqa: E402
from sglang_l3.quant import gptq_ref as R  # noqa: E402

K, N = 512, 320  # N not a multiple of the kernels' BN=64
K_DRY, N_DRY = 256, 96
MS = (1, 2, 3, 8, 16, 40, 130)
MS_DRY = (1, 3, 8, 19)
F16, BF16 = torch.float16, torch.bfloat16
# every 4-bit variant (the RDNA3 production case), then the other widths
CASES = [
    (4, gs, act, sym, fmt, dt)
    for gs, act in ((128, False), (64, True), (-1, False))
    for sym in (True, False)
    for fmt in ("v1", "v2")
    for dt in (F16, BF16)
] + [(bits, 128, False, True, "v1", dt) for bits in (2, 3, 8) for dt in (F16, BF16)]
# the layers every architecture's decode configs are forced onto
TABLE_LAYERS = [(4, 128, False, True, "v1", F16), (4, 64, True, False, "v2", BF16)] + [
    (bits, 64, False, False, "v2", F16) for bits in (2, 3, 8)
]


def case_name(bits: int, gs: int, act: bool, sym: bool, fmt: str, dtype: torch.dtype) -> str:
    return f"b{bits}-g{gs}{'-act' if act else ''}-{'sym' if sym else 'asym'}-{fmt}-{str(dtype)[6:]}"


def _layer(bits: int, gs: int, act: bool, sym: bool, fmt: str, dtype: torch.dtype, dev: str, k: int, n: int):
    g = torch.Generator().manual_seed(bits * 1000 + gs)
    L = R.quantize(
        torch.randn(k, n, generator=g) * 0.05, bits, gs, sym=sym, act_order=act, fmt=fmt, scale_dtype=dtype, seed=bits
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
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported (below)
        dev = "cpu"
    elif torch.cuda.is_available():
        dev = "cuda"
    else:
        print("gptq_check: no GPU visible to torch; use --dry-run to check on the CPU (interpreter)")
        return 2
    import triton
    from sglang_l3.quant import gptq_triton as T

    if args.dry_run:
        if not T.interpreting():
            print("gptq_check --dry-run: triton was imported before TRITON_INTERPRET=1 could be set")
            return 3
        from sglang_l3.testing.triton_probe import interpreter_problem
        from triton.runtime.interpreter import interpreter_builder

        problem = interpreter_problem()
        if problem:
            print(f"gptq_check --dry-run: {problem}")
            return 3

        # the overflow checker doubles the interpreter's time; the unit tests keep it on
        interpreter_builder.options = replace(interpreter_builder.options, sanitize_overflow=False)
        where = "CPU, Triton interpreter"
    else:
        where = torch.cuda.get_device_name(0)
    arch = T.arch_key(torch.device(dev))
    print(f"gptq_check: {where}, torch {torch.__version__}, triton {triton.__version__}, arch table {arch!r}")
    k, n = (K_DRY, N_DRY) if args.dry_run else (K, N)
    cases, ms = (CASES[::5], MS_DRY) if args.dry_run else (CASES, MS)
    rows: list[dict[str, Any]] = []
    failed = done = 0

    def record(row: dict[str, Any]) -> None:
        nonlocal failed
        rows.append(row)
        if not row["ok"]:
            failed += 1
            print(f"  MISMATCH {row}")

    for i, (bits, gs, act, sym, fmt, dtype) in enumerate(cases):
        if time.monotonic() - t0 > args.deadline_s:
            print(f"gptq_check: deadline reached after {done}/{len(cases)} cases")
            break
        name = case_name(bits, gs, act, sym, fmt, dtype)
        L = _layer(bits, gs, act, sym, fmt, dtype, dev, k, n)
        other = "v2" if fmt == "v1" else "v1"
        gidx = L.g_idx if act else None
        for m in ms:
            x = R.check_inputs(m, k, dtype, dev, seed=m)
            ref = x.float() @ L.w
            cfg = T.pick_config(
                m, k if gs == -1 else gs, act, K=k, N=n, bits=bits, arch=arch, cus=T.compute_units(x.device)
            )
            c = R.compare(T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, gidx, bits, gs, fmt), ref, dtype)
            bad = T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, gidx, bits, gs, other)
            neg_ok = not R.compare(bad, ref, dtype).ok
            record(
                {
                    "case": name,
                    "m": m,
                    "config": cfg.name,
                    "ok": c.ok and neg_ok,
                    "rel_l2": c.rel_l2,
                    "max_rel": c.max_rel,
                    "wrong_format_caught": neg_ok,
                }
            )
        done = i + 1

    # every decode config of every architecture table, split in 2 and unsplit
    # (the 4-bit layers on every table; the other widths on this device's table)
    configs_checked: list[str] = []
    complete = done == len(cases)
    for li, (bits, gs, act, sym, fmt, dtype) in enumerate(TABLE_LAYERS[:2] if args.dry_run else TABLE_LAYERS):
        if time.monotonic() - t0 > args.deadline_s:
            print("gptq_check: deadline reached in the table configs")
            complete = False
            break
        L = _layer(bits, gs, act, sym, fmt, dtype, dev, k, n)
        name = case_name(bits, gs, act, sym, fmt, dtype)
        for table in T.ARCH_TABLES if li < 2 else [arch]:
            for m, cfg in T.table_configs(table, bits, gs):
                for split in (2, 1):
                    c_run = replace(cfg, split_k=split, tile_group=cfg.tile_group and not act)
                    x = R.check_inputs(m, k, dtype, dev, seed=m)
                    out = T.gptq_gemm(
                        x, L.qweight, L.qzeros, L.scales, L.g_idx if act else None, bits, gs, fmt, config=c_run
                    )
                    c = R.compare(out, x.float() @ L.w, dtype)
                    tag = f"{table}:{c_run.name}"
                    configs_checked.append(tag)
                    record(
                        {
                            "case": f"table {name}",
                            "m": m,
                            "config": tag,
                            "ok": c.ok,
                            "rel_l2": c.rel_l2,
                            "max_rel": c.max_rel,
                        }
                    )

    worst = max((r["rel_l2"] for r in rows), default=0.0)
    kinds = sorted({r["config"].split(":")[-1].split("-")[0] for r in rows})
    print(
        f"gptq_check ({'dry run: ' if args.dry_run else ''}{where}): {done}/{len(cases)} cases x {len(ms)} M "
        f"+ {len(configs_checked)} table-config runs ({', '.join(kinds)}), {len(rows) - failed}/{len(rows)} match, "
        f"worst rel_l2 {worst:.3g}, {time.monotonic() - t0:.1f} s"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": dev,
                    "arch": arch,
                    "cases": len(cases),
                    "done": done,
                    "complete": complete,
                    "failed": failed,
                    "tables": sorted(T.ARCH_TABLES),
                    "table_configs": sorted(set(configs_checked)),
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 1 if failed or done == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
