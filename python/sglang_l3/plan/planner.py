"""The arithmetic of `sglang-l3 plan`: what fits where, per rank, and how fast an
agent's context comes back from L3.

Every figure derives from the model's config.json (geometry.py, weights.py), the
hardware given (or measured), and SGLang 0.5.23's own sizing rules, named where
they are used:

- device pools (kv_cache_configurator.py): with `--max-mamba-cache-size S` the
  Mamba pool takes (S + 1) state slots (one padding slot) out of what
  `--mem-fraction-static` leaves after the weights; the KV pool gets the rest,
  capped by `--max-total-tokens`. A running request holds
  MAMBA_SLOTS_PER_REQUEST slots (`_calculate_mamba_ratio`: 3, plus 2 tracking
  slots for `extra_buffer` with the overlap scheduler), and upstream caps
  `--max-running-requests` at S // that.
- host pools (pool_host/base.py, mamba.py): `--hicache-ratio r` gives
  (int(device tokens * r) // page + 1) * page KV tokens and
  int(Mamba slots * r) + 1 state slots per rank, booked against the host's
  available memory less a 10 GiB reserve (HICACHE_HOST_MEMORY_RESERVE_BYTES).
  In buffer-only mode they stage writes and restores and hold no context between
  requests.
- L3: one state page per checkpoint (every chunk of a chunked prefill, every
  finished turn), KV pages for every token, both on every rank; a restore reads
  the context's KV and its last state.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from sglang_l3.plan import weights as weights_mod
from sglang_l3.plan.geometry import ConfigError, Geometry

# SGLang 0.5.23, kv_cache_configurator.py MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO
# (3) + allocation_sizing.get_mamba_tracking_slots(extra_buffer=True, overlap=True) (2);
# test_plan.py checks both against the installed upstream.
MAMBA_SLOTS_PER_REQUEST = 5
# pool_host/base.py HICACHE_HOST_MEMORY_RESERVE_BYTES
HOST_RESERVE_BYTES = 10 << 30
# the fewest host state slots a buffer-only restore and a write can stage at once
MIN_HOST_STATES = 4
# the fewest host KV pages a streamed restore can work with: two pieces of 0.4 x
# the pool in flight must each hold a page (docs/state-budget.md)
MIN_HOST_PAGES = 3

# vendor peak dense 16-bit tensor throughput per GPU (TFLOPS), for the recompute
# estimate only; `--prefill-tps` replaces the estimate with a measured speed
GPU_TFLOPS = {"rx7900xtx": 122.8, "h100": 989.0, "h200": 989.0, "mi300x": 1307.4}

# The agent switch (issue 50): when more agents than the device holds take turns, the
# one that speaks after another waits for its context to come back from L3 while the
# last speaker's newest turn is still being written. benchmark/agent_switch.py times
# that switch against the store's own read of the same pages in one run:
# switch_vs_store median 1.25 at 131,072 tokens (1.24-1.31 at 32,768), Qwen3.5-27B
# TP=2 per rank, a quarter-context host buffer, the wait for the other agent's write
# 36-42 ms included; measured 2026-12-05 on a 2-core CPU box (docs/state-budget.md,
# "The agent switch"). The plan's measured-like-for-like switch = this x the disk read.
SWITCH_VS_STORE = 1.25


class PlanError(ValueError):
    """A plan that cannot work; the message names the setting to change."""


@dataclass
class Inputs:
    model: str
    config: dict[str, Any]
    model_source: str = ""
    quant: str = "bf16"
    tp: int = 1
    gpu_mem: int = 24 << 30
    mem_fraction_static: float = 0.85
    host_ram: int = 64 << 30
    nvme: int = 1 << 40
    disk_read_gbps: float = 3.0
    disk_source: str = "assumed: pass --disk-read-gbps or --measure DIR"
    link_gbps: float = 25.0
    link_source: str = "assumed: PCIe 4.0 x16; pass --link-gbps"
    agents: int = 2
    context: int = 262144
    page_size: int = 64
    checkpoint_interval: int = 8192
    host_buffer_tokens: int | None = None  # None: a quarter of a context
    kv_dtype_bytes: int = 2
    weights_bytes: int | None = None  # None: estimated from the config
    prefill_tps: float | None = None
    gpu: str = "rx7900xtx"
    mfu: float = 0.3
    store_dir: str = "/mnt/nvme/sglang-l3"


@dataclass
class Plan:
    model: str
    model_source: str
    tp: int
    quant: str
    # per rank
    weights_bytes: int
    weights_estimated: bool
    kv_bytes_per_token: int
    state_bytes: int
    states_per_context: int
    context_kv_bytes: int
    context_state_bytes: int
    device_pool_budget: int
    device_kv_tokens: int
    device_mamba_slots: int
    device_bytes: int
    device_contexts: int
    max_running_requests: int
    hicache_ratio: str
    host_kv_tokens: int
    host_mamba_slots: int
    host_bytes: int
    host_contexts: int
    # whole server
    host_bytes_all_ranks: int
    l3_context_bytes: int
    l3_cap: int
    l3_contexts: int
    agents: int
    context: int
    # an agent back from L3, one rank's share of the read (ranks read in parallel)
    restore_read_bytes: int
    restore_disk_s: float
    restore_h2d_s: float
    restore_s: float
    recompute_s: float | None
    recompute_source: str
    disk_read_gbps: float
    disk_source: str
    link_gbps: float
    link_source: str
    flags: list[str] = field(default_factory=list)
    store_config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # the agent switch, where more agents than the device holds take turns (else None):
    # one rank's bytes to bring back, the disk read of them (all ranks sharing the disk),
    # and that read x the ratio agent_switch.py measured (SWITCH_VS_STORE)
    switch_read_bytes: int | None = None
    switch_disk_s: float | None = None
    switch_s: float | None = None
    switch_vs_store: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _page_down(n: float, page: int) -> int:
    return int(n) // page * page


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _check_inputs(i: Inputs) -> None:
    checks = [
        (i.tp >= 1, "--tp must be at least 1"),
        (i.agents >= 1, "--agents must be at least 1"),
        (i.page_size >= 1, "--page-size must be at least 1"),
        (i.context >= i.page_size, f"--context ({i.context}) must hold at least one page ({i.page_size})"),
        (0 < i.mem_fraction_static < 1, f"--mem-fraction-static {i.mem_fraction_static} is not in (0, 1)"),
        (i.gpu_mem > 0, "--gpu-mem must be positive"),
        (i.host_ram > 0, "--host-ram must be positive"),
        (i.nvme > 0, "--nvme must be positive"),
        (i.disk_read_gbps > 0, "--disk-read-gbps must be positive"),
        (i.link_gbps > 0, "--link-gbps must be positive"),
        (
            i.checkpoint_interval >= i.page_size and i.checkpoint_interval % i.page_size == 0,
            f"--checkpoint-interval ({i.checkpoint_interval}) must be a multiple of --page-size ({i.page_size})",
        ),
        (i.prefill_tps is None or i.prefill_tps > 0, "--prefill-tps must be positive"),
        (0 < i.mfu <= 1, f"--mfu {i.mfu} is not in (0, 1]"),
    ]
    for ok, message in checks:
        if not ok:
            raise PlanError(message)


def make_plan(i: Inputs) -> Plan:
    _check_inputs(i)
    try:
        g = Geometry.from_config(i.config)
        g.check_tp(i.tp)
        params = weights_mod.count(i.config)
        weights = i.weights_bytes if i.weights_bytes is not None else weights_mod.bytes_per_rank(params, i.quant, i.tp)
    except (ConfigError, KeyError, ValueError) as e:
        raise PlanError(str(e) if not isinstance(e, KeyError) else f"config.json has no {e}") from e
    notes: list[str] = []
    kv = g.kv_bytes_per_token(i.tp, i.kv_dtype_bytes)
    state = g.state_bytes(i.tp)
    ctx = i.context
    states_per_ctx = math.ceil(ctx / i.checkpoint_interval)
    ctx_kv = ctx * kv

    # --- device: weights, then (slots + 1) states, then KV
    budget = int(i.gpu_mem * i.mem_fraction_static) - weights
    if budget <= 0:
        raise PlanError(
            f"--gpu-mem {_gib(i.gpu_mem)} x --mem-fraction-static {i.mem_fraction_static} = "
            f"{_gib(i.gpu_mem * i.mem_fraction_static)} does not hold the weights ({_gib(weights)} per rank, "
            f"{i.quant}): raise --tp, quantize (--quant), or raise --mem-fraction-static"
        )
    # a context on the device: its KV + the page admission charges every request (a prompt of the
    # whole pool is refused: patch prompt-fits-pool), its running slots, its state in the tree
    seat = ctx + i.page_size
    per_ctx = seat * kv + (MAMBA_SLOTS_PER_REQUEST + 1) * state
    fit = (budget - state) // per_ctx if budget > state else 0
    if fit < 1:
        raise PlanError(
            f"--context {ctx}: one context needs {_gib(per_ctx)} per rank on the device (KV {_gib(ctx_kv)} and a page "
            f"+ {MAMBA_SLOTS_PER_REQUEST + 1} Mamba slots of {_gib(state)}), but --gpu-mem x --mem-fraction-static "
            f"less the weights leaves {_gib(budget)}: raise --tp or --mem-fraction-static, or lower --context"
        )
    running = int(min(i.agents, fit))
    slots = running * (MAMBA_SLOTS_PER_REQUEST + 1)
    kv_tokens = _page_down((budget - (slots + 1) * state) / kv, i.page_size)
    device_contexts = kv_tokens // seat
    if device_contexts < i.agents:
        notes.append(
            f"{device_contexts} of {i.agents} contexts stay on the device; the others wait in L3 and come back "
            "when their agent speaks"
        )
    if g.max_position_embeddings and ctx > g.max_position_embeddings:
        notes.append(
            f"--context {ctx} is beyond the config's max_position_embeddings ({g.max_position_embeddings}): "
            "the model needs rope scaling (and --context-length is refused without it)"
        )

    # --- host: the buffer-only staging pools
    want_host = i.host_buffer_tokens if i.host_buffer_tokens is not None else _page_down(ctx / 4, i.page_size)
    if want_host < MIN_HOST_PAGES * i.page_size:
        raise PlanError(
            f"--host-buffer {want_host} tokens: a streamed restore needs at least {MIN_HOST_PAGES} pages "
            f"({MIN_HOST_PAGES * i.page_size} tokens at --page-size {i.page_size})"
        )
    ratio_value = max(want_host / kv_tokens, (MIN_HOST_STATES - 1) / slots)
    ratio = f"{math.ceil(ratio_value * 1e4) / 1e4:.4f}"  # rounded up: never less than asked
    r = float(ratio)
    host_kv_tokens = (int(kv_tokens * r) // i.page_size + 1) * i.page_size
    host_slots = int(slots * r) + 1
    host_bytes = host_kv_tokens * kv + host_slots * state
    host_all = host_bytes * i.tp
    if host_all > i.host_ram - HOST_RESERVE_BYTES:
        raise PlanError(
            f"--host-ram {_gib(i.host_ram)}: the host pools of {i.tp} rank(s) take {_gib(host_all)} "
            f"(--hicache-ratio {ratio}: {host_kv_tokens} KV tokens + {host_slots} states per rank), more than "
            f"the RAM less upstream's {_gib(HOST_RESERVE_BYTES)} reserve: lower --host-buffer"
        )

    # --- L3: every rank's KV and checkpoints of each context
    l3_ctx = i.tp * (ctx_kv + states_per_ctx * state)
    l3_contexts = i.nvme // l3_ctx
    away = max(0, i.agents - device_contexts)
    if l3_contexts < max(1, away):
        raise PlanError(
            f"--nvme {_gib(i.nvme)}: one context takes {_gib(l3_ctx)} in L3 ({i.tp} rank(s): KV + "
            f"{states_per_ctx} checkpoints); it holds {l3_contexts}, {max(1, away)} needed: raise --nvme, "
            "or raise --checkpoint-interval (fewer states)"
        )

    # --- an agent back from L3: every rank reads its share from the one disk, then H2D
    read = ctx_kv + state
    disk_s = i.tp * read / (i.disk_read_gbps * 1e9)
    h2d_s = read / (i.link_gbps * 1e9)
    if i.prefill_tps:
        recompute: float | None = ctx / i.prefill_tps
        source = f"given: {i.prefill_tps:.0f} tokens/s"
    elif i.gpu in GPU_TFLOPS:
        flops = weights_mod.prefill_flops(params, g, ctx) / i.tp
        recompute = flops / (GPU_TFLOPS[i.gpu] * 1e12 * i.mfu)
        source = (
            f"estimate: forward FLOPs from the config / ({i.gpu} peak {GPU_TFLOPS[i.gpu]} TFLOPS x {i.mfu} "
            "utilisation, assumed); measure and pass --prefill-tps"
        )
    else:
        recompute, source = None, f"unknown GPU {i.gpu!r}: pass --prefill-tps"
    # --- the agent switch: an agent that is not on the device speaks after another one
    switches = i.agents >= 2 and device_contexts < i.agents

    flags = [
        f"--tp-size {i.tp}",
        f"--mem-fraction-static {i.mem_fraction_static}",
        f"--max-total-tokens {kv_tokens}",
        f"--max-mamba-cache-size {slots}",
        f"--max-running-requests {running}",
        "--mamba-radix-cache-strategy extra_buffer",
        f"--page-size {i.page_size}",
        f"--chunked-prefill-size {i.checkpoint_interval}",
        f"--context-length {ctx}",
        "--enable-hierarchical-cache",
        "--hicache-storage-backend file",
        "--hicache-mem-layout buffer_only",
        f"--hicache-ratio {ratio}",
    ]
    if i.quant.startswith("gptq"):
        flags[1:1] = ["--quantization gptq", "--dtype float16"]  # GPTQ's activation dtype (docs/rdna3.md)
    store = {"store_dir": i.store_dir, "max_bytes": int(i.nvme)}
    return Plan(
        model=i.model,
        model_source=i.model_source,
        tp=i.tp,
        quant=i.quant,
        weights_bytes=int(weights),
        weights_estimated=i.weights_bytes is None,
        kv_bytes_per_token=kv,
        state_bytes=state,
        states_per_context=states_per_ctx,
        context_kv_bytes=ctx_kv,
        context_state_bytes=states_per_ctx * state,
        device_pool_budget=budget,
        device_kv_tokens=kv_tokens,
        device_mamba_slots=slots,
        device_bytes=int(weights) + kv_tokens * kv + (slots + 1) * state,
        device_contexts=int(device_contexts),
        max_running_requests=running,
        hicache_ratio=ratio,
        host_kv_tokens=host_kv_tokens,
        host_mamba_slots=host_slots,
        host_bytes=host_bytes,
        host_contexts=0,
        host_bytes_all_ranks=host_all,
        l3_context_bytes=l3_ctx,
        l3_cap=int(i.nvme),
        l3_contexts=int(l3_contexts),
        agents=i.agents,
        context=ctx,
        restore_read_bytes=read,
        restore_disk_s=disk_s,
        restore_h2d_s=h2d_s,
        restore_s=max(disk_s, h2d_s),
        recompute_s=recompute,
        recompute_source=source,
        disk_read_gbps=i.disk_read_gbps,
        disk_source=i.disk_source,
        link_gbps=i.link_gbps,
        link_source=i.link_source,
        flags=flags,
        store_config=store,
        notes=notes,
        switch_read_bytes=read if switches else None,
        switch_disk_s=disk_s if switches else None,
        switch_s=SWITCH_VS_STORE * disk_s if switches else None,
        switch_vs_store=SWITCH_VS_STORE if switches else None,
    )
