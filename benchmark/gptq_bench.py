"""GPTQ GEMM time vs an fp16 dense matmul, side by side in one run, with a correctness pass.

  python benchmark/gptq_bench.py [--bits 4] [--group 128] [--dtype fp16] [--json out.json]
  python benchmark/gptq_bench.py --model Qwen3.5-27B --tp 2   # also the model's per-rank shapes
  python benchmark/gptq_bench.py --sweep                      # also time alternative decode configs
  python benchmark/gptq_bench.py --dry-run                    # no GPU: the same rows, interpreted

Shapes: K = N in --sizes, and with --model the per-rank decode shapes of the
model's linear layers at --tp (q/k/v as SGLang's merged qkv_proj, o_proj,
gate_up_proj, down_proj, and the Gated-DeltaNet in_proj_qkvz / in_proj_ba /
out_proj), derived from the config `sglang-l3 plan` reads (sglang_l3.plan.models).
For each shape and M in --ms, every kernel the dispatcher could use on this device
(native gptq_gemm_rdna3 / sgl_kernel gptq_gemm if installed, Triton, torch
reference) is prepared from the same layer, checked against the fp32 reference
(the load-time self-check's comparison), then timed with device events; beside
them "triton-old" is the tl.dot kernel without the decode path (the kernel of
issue 53's table). The dense baseline is x @ W in fp16 with W already dequantized.

Timing: "eager" launches each call from Python (what issue 53 measured); "graph"
replays the calls captured in a CUDA/HIP graph, 20 per replay (how decode runs in
SGLang: launch overhead excluded). The summary tables give both, with the
"/ dense" ratio (kernel time / dense time in the same mode) and issue 53's target
(<= 0.5 at M = 1, 2, 4, 8; <= 1.0 at M = 16, K = N in 4096, 8192).

--sweep times alternative GEMV / split-K configs (tile, warps, split) for the
square shapes and prints the fastest beside the table's pick: the measurements
the per-architecture table in sglang_l3/quant/gptq_triton.py is filled from.

--dry-run (no GPU): the same rows on the CPU under the Triton interpreter
(TRITON_INTERPRET=1 is set here) at shapes scaled down 32x, the first and last
M only, every kernel checked against the reference, nothing timed. On a machine without a GPU and without
--dry-run it says so and exits 0. Exit 1 when a kernel does not match; 3 when the dry
run's interpreter cannot run the kernels here (said why: sglang_l3.testing.triton_probe).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

GRAPH_REPS = 20  # calls captured per graph replay
DRY_SCALE = 32  # --dry-run divides K and N by this (K kept a multiple of 128)
ISSUE_TARGET = {1: 0.5, 2: 0.5, 4: 0.5, 8: 0.5, 16: 1.0}  # M -> max "/ dense" (K = N in 4096, 8192)


def model_shapes(model: str, tp: int) -> list[tuple[str, int, int, int]]:
    """(layer, K, N, how many per forward) of one rank's GPTQ linear layers, from the
    config the planner reads. Attention heads split across ranks (a KV head kept per
    rank when there are fewer than ranks); the MLP and GDN projections split N
    (column-parallel) or K (row-parallel: o_proj, down_proj, out_proj)."""
    from sglang_l3.plan.geometry import Geometry, text_config
    from sglang_l3.plan.models import load

    _, config, _ = load(model)
    t, g = text_config(config), Geometry.from_config(config)
    g.check_tp(tp)
    hidden, inter = int(t["hidden_size"]), int(t["intermediate_size"])
    gate = 2 if t.get("attn_output_gate", True) else 1
    q = g.num_attention_heads * g.head_dim // tp
    kv = g.kv_heads_per_rank(tp) * g.head_dim
    k_dim = g.linear_num_key_heads * g.linear_key_head_dim // tp
    v_dim = g.linear_num_value_heads * g.linear_value_head_dim // tp
    full, gdn, layers = g.full_layers, g.gdn_layers, g.num_hidden_layers
    return [
        ("attn.qkv_proj", hidden, q * gate + 2 * kv, full),
        ("attn.o_proj", q, hidden, full),
        ("mlp.gate_up_proj", hidden, 2 * inter // tp, layers),
        ("mlp.down_proj", inter // tp, hidden, layers),
        ("gdn.in_proj_qkvz", hidden, 2 * k_dim + 2 * v_dim, gdn),
        ("gdn.in_proj_ba", hidden, 2 * g.linear_num_value_heads // tp, gdn),
        ("gdn.out_proj", v_dim, hidden, gdn),
    ]


class Timer:
    """Device-event timing of a callable, eager and graph-replayed."""

    def __init__(self, iters: int, enabled: bool) -> None:
        self.iters, self.enabled = iters, enabled

    def eager(self, fn: Callable[[], Any], warmup: int = 10) -> float | None:
        if not self.enabled:
            return None
        import torch

        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000.0 / self.iters  # microseconds

    def graph(self, fn: Callable[[], Any]) -> float | None:
        """Per call, GRAPH_REPS calls captured in one graph; None if capture fails."""
        if not self.enabled:
            return None
        import torch

        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(GRAPH_REPS):
                    fn()
        except Exception as e:  # noqa: BLE001 - reported in the row, eager time still stands
            print(f"  (graph capture failed: {type(e).__name__}: {e})")
            return None
        replays = max(1, self.iters // GRAPH_REPS)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000.0 / (replays * GRAPH_REPS)


def _fmt(v: float | None, width: int, spec: str) -> str:
    return f"{v:{width}{spec}}" if v is not None else f"{'-':>{width}s}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 8))
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--sizes", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--model", help="also time this model's per-rank layer shapes (a name `sglang-l3 plan` knows)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--sweep", action="store_true", help="also time alternative decode configs")
    ap.add_argument(
        "--sweep-deadline-s", type=float, default=300.0, help="stop sweeping this long after the benchmark started"
    )
    ap.add_argument("--dry-run", action="store_true", help="no GPU: interpreted, scaled down, not timed")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    args.t_start = time.monotonic()

    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gptq_bench: needs a GPU (CUDA or ROCm); none found on this machine, nothing measured.")
        return 0

    from sglang_l3.quant import dispatch
    from sglang_l3.quant import gptq_ref as R
    from sglang_l3.quant import gptq_triton as T

    if args.dry_run and not T.interpreting():
        print("gptq_bench --dry-run: triton was imported before TRITON_INTERPRET=1 could be set")
        return 3
    if args.dry_run:  # a logic check: the first and last M, where the interpreter can run them
        from sglang_l3.testing.triton_probe import interpreter_problem

        problem = interpreter_problem()
        if problem:
            print(f"gptq_bench --dry-run: {problem}")
            return 3
        args.ms = sorted({args.ms[0], args.ms[-1]})
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device("cpu" if args.dry_run else "cuda")
    info = dispatch.device_info(dev) if not args.dry_run else dispatch.DeviceInfo("cpu", False, None)
    found = dispatch.installed()
    arch = T.arch_key(dev)
    timer = Timer(args.iters, enabled=not args.dry_run)
    name = "CPU (Triton interpreter, dry run: nothing timed)" if args.dry_run else torch.cuda.get_device_name(dev)
    print(
        f"device {name} (arch table {arch!r}, {T.compute_units(dev)} compute units), {args.bits}-bit "
        f"g{args.group} {args.dtype}; native probe: {'; '.join(found.notes) or 'ok'}"
    )

    shapes: list[tuple[str, int, int, int]] = [(f"K=N={s}", s, s, 0) for s in args.sizes]
    if args.model:
        shapes += [(f"{args.model}/tp{args.tp} {n}", k, nn, c) for n, k, nn, c in model_shapes(args.model, args.tp)]
    rows: list[dict[str, Any]] = []
    hdr = f"{'shape':40s} {'K':>6s} {'N':>6s} {'M':>3s} {'kernel':40s} {'eager us':>9s} {'graph us':>9s} {'/dense':>7s} check"
    print(hdr)
    layers: dict[tuple[int, int], Any] = {}
    for label, k0, n0, count in shapes:
        k, n = k0, n0
        if args.dry_run:  # scaled down, K a multiple of the group and of 128
            k, n = max(128, k0 // DRY_SCALE // 128 * 128), max(8, n0 // DRY_SCALE // 8 * 8)
        gs = args.group if args.group > 0 else k
        if k % gs:
            print(f"{label}: K={k} is not a multiple of group {gs}: skipped")
            continue
        if (k, n) not in layers:
            g = torch.Generator(device=dev).manual_seed(k * 7 + n)
            q = torch.randint(0, 1 << args.bits, (k, n), device=dev, generator=g)
            G = k // gs
            zeros = torch.full((G, n), 1 << (args.bits - 1), device=dev, dtype=torch.int64)
            scales = (torch.rand(G, n, device=dev, generator=g) * 0.01 + 0.001).to(dtype)
            ck = dispatch.Checkpoint(R.pack_rows(q, args.bits), R.encode_zeros(zeros, args.bits, "v1"), scales, None)
            layer, _ = dispatch.pack_layer(ck, bits=args.bits, group_size=gs, desc_act=False, declared="v1")
            w32 = R.dequantize(ck.qweight, ck.qzeros, scales, layer.g_idx_or_sequential(), args.bits, "v1")
            layers[(k, n)] = (layer, w32, w32.to(torch.float16))
        layer, w32, w16 = layers[(k, n)]
        for m in args.ms:
            x = R.check_inputs(m, k, dtype, dev, seed=m)
            xh = x.to(torch.float16)
            ref = x.float() @ w32
            base = {"shape": label, "K": k, "N": n, "m": m, "per_forward": count}
            # bound as defaults (B023); the timers call them within this iteration anyway
            dense = {"eager": timer.eager(lambda xh=xh, w16=w16: xh @ w16)}
            dense["graph"] = timer.graph(lambda xh=xh, w16=w16: xh @ w16)
            rows.append({**base, "kernel": "dense fp16 matmul", "config": "", "us": dense, "check": "baseline"})
            runners: list[tuple[str, str, Any]] = []
            old_cfg = T.legacy_config(m, gs, False)
            runners.append(
                (
                    "triton-old (tl.dot, no split-K)",
                    old_cfg.name,
                    lambda x, cfg=old_cfg, L=layer, gs=gs: T.gptq_gemm(
                        x, L.qweight, L.qzeros, L.scales, None, args.bits, gs, "v1", config=cfg
                    ),
                )
            )
            for kern in dispatch.candidates(found):
                why = kern.unavailable(layer, dtype, info)
                if why:
                    rows.append({**base, "kernel": kern.name, "config": "", "us": {}, "check": f"n/a: {why}"})
                    continue
                cfg_name = ""
                if kern.name == "triton":
                    cfg_name = T.pick_config(
                        m, gs, False, K=k, N=n, bits=args.bits, arch=arch, cus=T.compute_units(dev)
                    ).name
                runners.append((kern.name, cfg_name, dispatch.LayerGemm(kern.prepare(layer, dtype).run, None, n, "")))
            for kname, cfg_name, run in runners:
                c = R.compare(run(x), ref, dtype)
                us = {
                    "eager": timer.eager(lambda run=run, x=x: run(x)),
                    "graph": timer.graph(lambda run=run, x=x: run(x)),
                }
                rows.append(
                    {
                        **base,
                        "kernel": kname,
                        "config": cfg_name,
                        "us": us,
                        "vs_dense": {mode: _ratio(us[mode], dense[mode]) for mode in us},
                        "check": ("ok " if c.ok else "MISMATCH ") + str(c),
                    }
                )
            for r in rows:
                if r["shape"] == label and r["m"] == m and not r.get("_printed"):
                    r["_printed"] = True
                    us = r["us"]
                    ratio = (r.get("vs_dense") or {}).get("graph") or (r.get("vs_dense") or {}).get("eager")
                    print(
                        f"{label[:40]:40s} {k:6d} {n:6d} {m:3d} {r['kernel'][:40]:40s} "
                        f"{_fmt(us.get('eager'), 9, '.1f')} {_fmt(us.get('graph'), 9, '.1f')} "
                        f"{_fmt(ratio, 6, '.2f')}x {r['check']}"
                    )
    for r in rows:
        r.pop("_printed", None)

    summary(rows, args.ms, timed=not args.dry_run)
    sweep_rows: list[dict[str, Any]] = []
    if args.sweep:
        sweep_rows = sweep(args, layers, shapes, dtype, dev, arch, timer)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": arch, "rows": rows, "sweep": sweep_rows}, f, indent=1)
    bad = [r for r in rows + sweep_rows if r["check"].startswith("MISMATCH")]
    if bad:
        print(f"gptq_bench: {len(bad)} kernel result(s) do NOT match the reference")
    return 1 if bad else 0


def _pick(rows: list[dict[str, Any]], shape: str, m: int, kernel: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["shape"] == shape and r["m"] == m and r["kernel"] == kernel), None)


def summary(rows: list[dict[str, Any]], ms: list[int], *, timed: bool) -> None:
    """Issue 53's table, old and new Triton kernels side by side, per timing mode;
    then the model's layers weighted by how often one forward runs them."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    for mode in ("eager", "graph") if timed else ("eager",):
        print(
            f"\n== {mode}: {'one Python launch per call (as issue 53 measured)' if mode == 'eager' else 'CUDA/HIP graph replay (as decode runs)'}"
        )
        print(
            "| shape | K | N | M | dense fp16 µs | Triton old µs | old / dense | Triton new µs | new / dense | new config |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        misses, judged = [], 0
        for shape in shapes:
            for m in ms:
                d, o, nw = (
                    _pick(rows, shape, m, k) for k in ("dense fp16 matmul", "triton-old (tl.dot, no split-K)", "triton")
                )
                if d is None:
                    continue
                du = d["us"].get(mode)
                ou = o["us"].get(mode) if o else None
                nu = nw["us"].get(mode) if nw else None
                ro, rn = _ratio(ou, du), _ratio(nu, du)
                cfg = nw["config"] if nw else "n/a"
                print(
                    f"| {shape} | {d['K']} | {d['N']} | {m} | {_fmt(du, 1, '.1f')} | {_fmt(ou, 1, '.1f')} | "
                    f"{_fmt(ro, 1, '.2f')} | {_fmt(nu, 1, '.1f')} | {_fmt(rn, 1, '.2f')} | {cfg} |"
                )
                if shape in ("K=N=4096", "K=N=8192") and m in ISSUE_TARGET and timed:
                    judged += 1
                    if rn is None or rn > ISSUE_TARGET[m]:
                        misses.append(f"{shape} M={m}: {_fmt(rn, 1, '.2f')} > {ISSUE_TARGET[m]}")
        if timed and judged:
            verdict = "MET" if not misses else "NOT met: " + "; ".join(misses)
            print(f"issue 53 target ({mode}: / dense <= 0.5 at M = 1, 2, 4, 8, <= 1.0 at M = 16): {verdict}")
        model_rows = [r for r in rows if r["per_forward"] and r["kernel"] == "dense fp16 matmul"]
        for m in ms if model_rows and timed else ():
            tot = {"dense": 0.0, "old": 0.0, "new": 0.0}
            complete = True
            for d in (r for r in model_rows if r["m"] == m):
                o = _pick(rows, d["shape"], m, "triton-old (tl.dot, no split-K)")
                nw = _pick(rows, d["shape"], m, "triton")
                for key, r in (("dense", d), ("old", o), ("new", nw)):
                    v = r["us"].get(mode) if r else None
                    if v is None:
                        complete = False
                    else:
                        tot[key] += v * d["per_forward"]
            if complete:
                print(
                    f"model linear layers per forward, M={m} ({mode}): dense {tot['dense']:.0f} µs, "
                    f"Triton old {tot['old']:.0f} µs ({tot['old'] / tot['dense']:.2f}x), "
                    f"new {tot['new']:.0f} µs ({tot['new'] / tot['dense']:.2f}x)"
                )


def sweep_configs(m: int, picked: Any) -> list[Any]:
    """Alternatives to the table's pick for one M: tiles, warps and splits."""
    out = []
    splits = sorted({max(1, picked.split_k // 4), max(1, picked.split_k // 2), picked.split_k, picked.split_k * 2, 32})
    if picked.kind == "gemv":
        tiles = [(32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (64, 256, 4), (128, 64, 4), (128, 128, 8)]
    else:
        tiles = [(32, 32, 4), (64, 32, 4), (64, 64, 4), (64, 128, 4), (128, 32, 4), (128, 64, 8)]
    for bn, bk, nw in tiles:
        for s in splits:
            out.append(replace(picked, BN=bn, BK=bk, num_warps=nw, split_k=s))
    return out


def sweep(args, layers, shapes, dtype, dev, arch: str, timer: Timer) -> list[dict[str, Any]]:
    import torch
    from sglang_l3.quant import gptq_ref as R
    from sglang_l3.quant import gptq_triton as T

    out: list[dict[str, Any]] = []
    left = args.sweep_deadline_s - (time.monotonic() - args.t_start)
    print(f"\n== sweep: alternative decode configs (graph-replay µs), {left:.0f} s left for it")
    for label, k0, n0, count in shapes:
        if count:  # the square shapes only
            continue
        k, n = (
            (k0, n0) if not args.dry_run else (max(128, k0 // DRY_SCALE // 128 * 128), max(8, n0 // DRY_SCALE // 8 * 8))
        )
        if (k, n) not in layers:
            continue
        layer, w32, _ = layers[(k, n)]
        gs = args.group if args.group > 0 else k
        for m in (1, 4, 16):
            x = R.check_inputs(m, k, dtype, dev, seed=m)
            ref = x.float() @ w32
            picked = T.pick_config(m, gs, False, K=k, N=n, bits=args.bits, arch=arch, cus=T.compute_units(dev))
            results = []
            cands = [picked] + [c for c in sweep_configs(m, picked) if c != picked]
            if args.dry_run:
                cands = cands[:: max(1, len(cands) // 2)]
            for cfg in cands:
                if time.monotonic() - args.t_start > args.sweep_deadline_s:
                    print("  sweep deadline reached")
                    return out
                cfg = replace(cfg, tile_group=cfg.tile_group and gs % cfg.BK == 0)

                def run(x=x, cfg=cfg, L=layer, gs=gs) -> torch.Tensor:
                    return T.gptq_gemm(x, L.qweight, L.qzeros, L.scales, None, args.bits, gs, "v1", config=cfg)

                try:
                    c = R.compare(run(), ref, dtype)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    print(f"  {label} M={m} {cfg.name}: failed ({type(e).__name__}: {str(e)[:200]})")
                    continue
                us = timer.graph(run) or timer.eager(run)
                row = {"shape": label, "K": k, "N": n, "m": m, "config": cfg.name, "picked": cfg == picked, "us": us}
                row["check"] = ("ok " if c.ok else "MISMATCH ") + str(c)
                out.append(row)
                results.append(row)
            ranked = sorted(results, key=lambda r: (r["us"] is None, r["us"] or 0.0))
            mine = next((r for r in results if r["picked"]), None)
            best = ", ".join(f"{r['config']} {_fmt(r['us'], 1, '.1f')}" for r in ranked[:3])
            print(
                f"  {label} M={m}: table {mine['config'] if mine else picked.name} {_fmt(mine['us'] if mine else None, 1, '.1f')} µs; fastest: {best}"
            )
            bad = [r for r in results if r["check"].startswith("MISMATCH")]
            for r in bad:
                print(f"  MISMATCH {label} M={m} {r['config']}: {r['check']}")
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
