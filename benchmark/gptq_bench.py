"""GPTQ GEMM time vs an fp16 dense matmul, side by side in one run, with a correctness pass.

  python benchmark/gptq_bench.py [--bits 4] [--group 128] [--dtype fp16] [--json out.json]

For K = N in (4096, 8192) and M in (1, 16, 128): every kernel the dispatcher
could use on this device (native gptq_gemm_rdna3 / sgl_kernel gptq_gemm if
installed, Triton, torch reference) is prepared from the same layer, checked
against the fp32 reference (the load-time self-check's comparison), then timed
with device events; the dense baseline is x @ W with W already dequantized.
On a machine without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _time(fn, iters: int, warmup: int = 10) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters  # microseconds


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 8))
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gptq_bench: needs a GPU (CUDA or ROCm); none found on this machine, nothing measured.")
        return 0

    from sglang_l3.quant import dispatch
    from sglang_l3.quant import gptq_ref as R

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device("cuda")
    info = dispatch.device_info(dev)
    found = dispatch.installed()
    print(
        f"device {torch.cuda.get_device_name(dev)} ({info.arch or 'cuda'}), {args.bits}-bit g{args.group} "
        f"{args.dtype}; native probe: {'; '.join(found.notes) or 'ok'}"
    )
    rows: list[dict[str, Any]] = []
    hdr = f"{'K=N':>5s} {'M':>4s} {'kernel':42s} {'us':>9s} {'TFLOP/s':>8s} {'/ dense':>8s} {'check':s}"
    print(hdr)
    for size in args.sizes:
        g = torch.Generator(device=dev).manual_seed(size)
        q = torch.randint(0, 1 << args.bits, (size, size), device=dev, generator=g)
        G = size // args.group
        zeros = torch.full((G, size), 1 << (args.bits - 1), device=dev, dtype=torch.int64)
        scales = (torch.rand(G, size, device=dev, generator=g) * 0.01 + 0.001).to(dtype)
        ck = dispatch.Checkpoint(R.pack_rows(q, args.bits), R.encode_zeros(zeros, args.bits, "v1"), scales, None)
        layer, _ = dispatch.pack_layer(ck, bits=args.bits, group_size=args.group, desc_act=False, declared="v1")
        w32 = R.dequantize(ck.qweight, ck.qzeros, scales, layer.g_idx_or_sequential(), args.bits, "v1")
        w16 = w32.to(torch.float16)
        for m in args.ms:
            x = R.check_inputs(m, size, dtype, dev, seed=m)
            xh = x.to(torch.float16)
            # bound as defaults (B023); _time calls it within this iteration anyway
            dense_us = _time(lambda xh=xh, w16=w16: xh @ w16, args.iters)
            flops = 2.0 * m * size * size
            ref = x.float() @ w32
            rows.append(
                {
                    "size": size,
                    "m": m,
                    "kernel": "dense fp16 matmul",
                    "us": dense_us,
                    "tflops": flops / dense_us / 1e6,
                    "vs_fp16": 1.0,
                    "check": "baseline",
                }
            )
            for k in dispatch.candidates(found):
                why = k.unavailable(layer, dtype, info)
                if why:
                    rows.append(
                        {
                            "size": size,
                            "m": m,
                            "kernel": k.name,
                            "us": None,
                            "tflops": None,
                            "vs_fp16": None,
                            "check": f"n/a: {why}",
                        }
                    )
                    continue
                run = dispatch.LayerGemm(k.prepare(layer, dtype).run, None, size, k.name)
                c = R.compare(run(x), ref, dtype)
                us = _time(lambda run=run, x=x: run(x), args.iters)
                rows.append(
                    {
                        "size": size,
                        "m": m,
                        "kernel": k.name,
                        "us": us,
                        "tflops": flops / us / 1e6,
                        "vs_fp16": us / dense_us,
                        "check": ("ok " if c.ok else "MISMATCH ") + str(c),
                    }
                )
            for r in rows:
                if r["size"] == size and r["m"] == m and not r.get("_printed"):
                    r["_printed"] = True
                    us = f"{r['us']:9.1f}" if r["us"] is not None else f"{'-':>9s}"
                    tf = f"{r['tflops']:8.2f}" if r["tflops"] is not None else f"{'-':>8s}"
                    ratio = f"{r['vs_fp16']:7.2f}x" if r["vs_fp16"] is not None else f"{'-':>8s}"
                    print(f"{size:5d} {m:4d} {r['kernel'][:42]:42s} {us} {tf} {ratio} {r['check']}")
    for r in rows:
        r.pop("_printed", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if r["check"].startswith("MISMATCH")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
