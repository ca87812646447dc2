"""`sglang-l3 plan`: what fits where for N agents x a context length, and the flags."""

from __future__ import annotations

import argparse
import json
import re
import sys

from sglang_l3.plan import models
from sglang_l3.plan.geometry import ConfigError
from sglang_l3.plan.planner import GPU_TFLOPS, Inputs, PlanError, make_plan
from sglang_l3.plan.render import text
from sglang_l3.plan.weights import QUANT_BITS
from sglang_l3.storage.config import ConfigError as SizeError
from sglang_l3.storage.config import parse_size

KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
# Refused with the reason (issue 50): the plan would size pools for 1-byte KV while the
# printed launch command serves the model's dtype (2 bytes), and fp8 KV has never been
# through L3 here.
REFUSED_KV_DTYPES = {
    "fp8": (
        "--kv-dtype fp8 is not planned: fp8 KV has never been restored from L3 by sglang-l3 "
        "(no bit-exact check against an fp8 server without a cache), and on gfx1100 (RX 7900 "
        "XTX) fp8 KV decode attention is slower than bf16 (no native FP8; vLLM #56992); plan "
        "with --kv-dtype bf16"
    ),
}


def parse_tokens(value: str, name: str) -> int:
    """'262144', '256K' or '1M' (K = 1024 tokens, as context lengths are quoted)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", value)
    if not m:
        raise PlanError(f"{name} {value!r}: a token count like 262144, 256K or 1M")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="what fits where (device / host / L3) for N agents and the launch flags",
        description=__doc__,
    )
    p.add_argument(
        "--model", required=True, help=f"a config.json (or its directory), or one of: {', '.join(models.names())}"
    )
    p.add_argument("--quant", default="bf16", choices=list(QUANT_BITS), help="weight format (default bf16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs)")
    p.add_argument("--gpu-mem", default="24GiB", help="memory per GPU (default 24GiB)")
    p.add_argument("--mem-fraction-static", type=float, default=0.85, help="SGLang's static fraction (default 0.85)")
    p.add_argument("--host-ram", default="64GiB", help="host RAM (default 64GiB)")
    p.add_argument("--nvme", default="1TiB", help="L3 store budget on the NVMe (the store cap; default 1TiB)")
    p.add_argument("--disk-read-gbps", type=float, default=None, help="the disk's read speed through the store, GB/s")
    p.add_argument("--measure", metavar="DIR", default=None, help="measure the read speed on DIR (storage_bench.py)")
    p.add_argument("--measure-size", default="1GiB", help="bytes --measure writes and reads (default 1GiB)")
    p.add_argument("--link-gbps", type=float, default=None, help="host->device GB/s per GPU (default 25: PCIe 4.0 x16)")
    p.add_argument("--agents", type=int, default=2, help="number of agents (default 2)")
    p.add_argument("--context", default="256K", help="tokens per agent context (default 256K)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument(
        "--checkpoint-interval", type=int, default=8192, help="tokens between Mamba checkpoints (chunked prefill)"
    )
    p.add_argument("--host-buffer", default=None, help="host staging tokens per rank (default: a quarter of a context)")
    p.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPE_BYTES))
    p.add_argument("--weights-gib", type=float, default=None, help="weights per rank, GiB (replaces the estimate)")
    p.add_argument("--prefill-tps", type=float, default=None, help="measured prefill tokens/s (replaces the estimate)")
    p.add_argument("--gpu", default="rx7900xtx", help=f"for the recompute estimate: {', '.join(GPU_TFLOPS)}")
    p.add_argument("--store-dir", default="/mnt/nvme/sglang-l3", help="store_dir in the printed flags")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    if args.kv_dtype in REFUSED_KV_DTYPES:
        raise PlanError(REFUSED_KV_DTYPES[args.kv_dtype])
    try:
        name, config, source = models.load(args.model)
        sizes = {
            k: parse_size(getattr(args, k), name="--" + k.replace("_", "-"), strict=True)
            for k in ("gpu_mem", "host_ram", "nvme")
        }
    except (ConfigError, SizeError) as e:
        raise PlanError(str(e)) from e
    i = Inputs(
        model=name,
        config=config,
        model_source=source,
        quant=args.quant,
        tp=args.tp,
        mem_fraction_static=args.mem_fraction_static,
        agents=args.agents,
        context=parse_tokens(args.context, "--context"),
        page_size=args.page_size,
        checkpoint_interval=args.checkpoint_interval,
        host_buffer_tokens=None if args.host_buffer is None else parse_tokens(args.host_buffer, "--host-buffer"),
        kv_dtype_bytes=KV_DTYPE_BYTES[args.kv_dtype],
        weights_bytes=None if args.weights_gib is None else int(args.weights_gib * (1 << 30)),
        prefill_tps=args.prefill_tps,
        gpu=args.gpu,
        store_dir=args.store_dir,
        gpu_mem=sizes["gpu_mem"],
        host_ram=sizes["host_ram"],
        nvme=sizes["nvme"],
    )
    if args.disk_read_gbps is not None and args.measure:
        raise PlanError("--disk-read-gbps and --measure: give one")
    if args.disk_read_gbps is not None:
        i.disk_read_gbps, i.disk_source = args.disk_read_gbps, "given"
    elif args.measure:
        from sglang_l3.plan.measure import MeasureError, read_gbps

        try:
            i.disk_read_gbps = read_gbps(args.measure, args.measure_size)
        except MeasureError as e:
            raise PlanError(str(e)) from e
        i.disk_source = f"measured on {args.measure} by storage_bench.py"
    if args.link_gbps is not None:
        i.link_gbps, i.link_source = args.link_gbps, "given"
    return i


def run(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(inputs_from_args(args))
    except PlanError as e:
        if args.json:
            print(json.dumps({"error": str(e)}))
        print(f"sglang-l3 plan: refused: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=2) if args.json else text(plan))
    return 0
