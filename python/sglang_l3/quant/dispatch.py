"""Pick the GPTQ GEMM for one layer, once, after its weights are loaded.

Order (first that is available *and* passes the self-check wins):
  1. an installed native gptq_gemm_rdna3 op (gfx1100; 4-bit symmetric; group > 0;
     N % 8 == 0; groups contiguous), found in the library named by
     SGLANG_L3_GPTQ_OPS, vLLM's _rocm_C, or sgl_kernel; its schema is probed
  2. torch.ops.sgl_kernel.gptq_gemm from a GPTQ-enabled sgl-kernel build (fp16)
  3. our Triton fused dequant-GEMM
  4. the torch reference (dequantize + matmul)

Self-check: every candidate runs on the real layer (CHECK_MS: one M per Triton
launch shape, a spread of output columns) and is compared with the fp32 reference
built from the checkpoint tensors as loaded. A mismatch or an exception is
logged as an error naming the layer, and the next kernel is tried: a kernel that
has never run on this GPU must not produce garbage silently.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from sglang_l3.quant import gptq_ref as ref
from sglang_l3.quant.gptq_ref import ZeroFormat

logger = logging.getLogger("sglang_l3.quant")

ENV_OPS = "SGLANG_L3_GPTQ_OPS"
ENV_NATIVE = "SGLANG_L3_GPTQ_NATIVE"  # "0": never probe native ops
NATIVE_ARCHS = ("gfx1100",)
# The self-check's M values: one per Triton launch shape (gptq_triton.pick_config):
# GEMV holding 1, 2 and 4 rows (M = 3 also checks the masked fourth row), tl.dot with
# a split over K (M <= 16), then the 32- and 64-row tl.dot tiles.
CHECK_MS = (1, 2, 3, 8, 19, 40)
Runner = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Prepared:
    run: Runner  # x2d -> out2d
    tensors: dict[str, torch.Tensor]  # what run() reads; the layer keeps exactly these


# --------------------------------------------------------------------------- #
# What the dispatcher knows about the device and the layer
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class DeviceInfo:
    type: str  # torch device type of the weights
    hip: bool
    arch: str | None  # "gfx1100" (without feature suffixes) on ROCm, else None


def device_info(device: torch.device) -> DeviceInfo:
    hip = torch.version.hip is not None
    arch = None
    if hip and device.type == "cuda":
        name = torch.cuda.get_device_properties(device).gcnArchName
        arch = name.split(":", 1)[0]
    return DeviceInfo(device.type, hip, arch)


@dataclass
class PackedLayer:
    """A layer as the kernels see it (after sorting act-order rows)."""

    qweight: torch.Tensor  # int32 [K*bits/32, N]
    qzeros: torch.Tensor  # int32 [G, N*bits/32]
    scales: torch.Tensor  # [G, N], activation dtype
    g_idx: torch.Tensor | None  # None: group of row k is k // group_size
    perm: torch.Tensor | None  # act-order input permutation (x[:, perm]), or None
    bits: int
    group_size: int  # effective, > 0 (K when channel-wise)
    fmt: ZeroFormat
    symmetric: bool
    K: int
    N: int
    channelwise: bool = False

    def g_idx_or_sequential(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx
        k = torch.arange(self.K, device=self.qweight.device, dtype=torch.int32)
        return k // self.group_size


@dataclass(frozen=True)
class Checkpoint:
    """The layer's tensors exactly as loaded (the self-check's ground truth)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #
class GemmKernel(ABC):
    name: str

    @abstractmethod
    def unavailable(self, layer: PackedLayer, dtype: torch.dtype, dev: DeviceInfo) -> str | None:
        """None when the kernel can serve this layer, else the reason it cannot."""

    @abstractmethod
    def prepare(self, layer: PackedLayer, dtype: torch.dtype) -> Prepared:
        """Bring the weights into the kernel's layout."""


class TorchKernel(GemmKernel):
    name = "torch-reference"

    def unavailable(self, layer, dtype, dev):
        return None

    def prepare(self, layer, dtype):
        g = layer.g_idx_or_sequential()
        qw, qz, s, bits, fmt = layer.qweight, layer.qzeros, layer.scales, layer.bits, layer.fmt
        return Prepared(
            lambda x: ref.torch_gemm(x, qw, qz, s, g, bits, fmt), {"qweight": qw, "qzeros": qz, "scales": s, "g_idx": g}
        )


class TritonKernel(GemmKernel):
    name = "triton"

    def unavailable(self, layer, dtype, dev):
        try:
            from sglang_l3.quant import gptq_triton
        except Exception as e:  # noqa: BLE001 - any import failure means "no Triton"
            return f"triton unavailable: {type(e).__name__}: {e}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"activation dtype {dtype} (fp16/bf16 only)"
        if dev.type == "cpu" and not gptq_triton.interpreting():
            return "CPU tensors (Triton runs on CPU only under TRITON_INTERPRET=1)"
        if dev.type not in ("cuda", "cpu"):
            return f"device type {dev.type}"
        return None

    def prepare(self, layer, dtype):
        from sglang_l3.quant.gptq_triton import arch_key, gptq_gemm

        qw, qz, s, g = layer.qweight, layer.qzeros, layer.scales, layer.g_idx
        bits, gs, fmt = layer.bits, layer.group_size, layer.fmt
        tensors = {"qweight": qw, "qzeros": qz, "scales": s}
        if g is not None:
            tensors["g_idx"] = g
        # the launch shape is picked per call from M (GEMV / split-K / tiles), from
        # this architecture's table: no autotune at request time
        arch = arch_key(qw.device)
        return Prepared(lambda x: gptq_gemm(x, qw, qz, s, g, bits, gs, fmt, arch=arch), tensors)


# --------------------------------------------------------------------------- #
# Native ops: discovery and schema probing
# --------------------------------------------------------------------------- #
_ROLE_NAMES = {
    "x": ("a", "input", "x", "in_a"),
    "qweight": ("b_q_weight", "qweight", "b_qweight", "w_q"),
    "qzeros": ("b_qzeros", "b_gptq_qzeros", "qzeros", "zeros"),
    "scales": ("b_scales", "b_gptq_scales", "scales"),
    "g_idx": ("b_g_idx", "g_idx", "b_q_perm", "perm"),
    "use_v2": ("use_v2_format",),
    "shuffle": ("use_shuffle", "use_exllama"),
    "bits": ("bit", "bits", "num_bits"),
}
_ROLE_OF = {n: role for role, names in _ROLE_NAMES.items() for n in names}
_ROLE_TYPE = {
    "x": "Tensor",
    "qweight": "Tensor",
    "qzeros": "Tensor",
    "scales": "Tensor",
    "g_idx": "Tensor",
    "use_v2": "bool",
    "shuffle": "bool",
    "bits": "int",
}
_REQUIRED = ("x", "qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class NativeOp:
    qualname: str  # "ns::name"
    schema: str
    roles: tuple[tuple[str, str], ...]  # (argument name, role) in schema order
    fn: Any = field(compare=False, repr=False)

    @property
    def takes_v2(self) -> bool:
        return any(r == "use_v2" for _, r in self.roles)

    def call(self, x, qweight, qzeros, scales, g_idx, *, v2: bool, shuffle: bool, bits: int):
        value = {
            "x": x,
            "qweight": qweight,
            "qzeros": qzeros,
            "scales": scales,
            "g_idx": g_idx,
            "use_v2": v2,
            "shuffle": shuffle,
            "bits": bits,
        }
        return self.fn(*[value[r] for _, r in self.roles])


def probe_schema(qualname: str, fn: Any) -> tuple[NativeOp | None, str | None]:
    """Map an op's schema onto GPTQ GEMM roles by argument name (the signature of
    gptq_gemm_rdna3 changed across vLLM versions). Unknown arguments: refused."""
    try:
        schema = fn.default._schema
    except Exception as e:  # noqa: BLE001
        return None, f"{qualname}: no schema ({type(e).__name__}: {e})"
    roles = []
    for arg in schema.arguments:
        role = _ROLE_OF.get(arg.name)
        if role is None:
            return None, f"{qualname}: unrecognised argument {arg.name!r} in {schema}"
        if str(arg.type) != _ROLE_TYPE[role]:
            return None, f"{qualname}: argument {arg.name!r} is {arg.type}, expected {_ROLE_TYPE[role]}"
        roles.append((arg.name, role))
    missing = [r for r in _REQUIRED if r not in {r for _, r in roles}]
    if missing:
        return None, f"{qualname}: schema lacks {missing}: {schema}"
    if len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor":
        return None, f"{qualname}: does not return one Tensor: {schema}"
    return NativeOp(qualname, str(schema), tuple(roles), fn), None


def lookup_op(namespace: str, name: str) -> Any | None:
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


@dataclass
class NativeDiscovery:
    rdna3: list[tuple[NativeOp, NativeOp | None]] = field(default_factory=list)  # (op, wmma op)
    sgl_gemm: NativeOp | None = None
    sgl_shuffle: Any | None = None
    notes: list[str] = field(default_factory=list)


def _load_library(path: str, notes: list[str]) -> bool:
    try:
        torch.ops.load_library(path)
        notes.append(f"loaded {path}")
        return True
    except Exception as e:  # noqa: BLE001 - report, never crash the server on a probe
        notes.append(f"could not load {path}: {type(e).__name__}: {e}")
        return False


def _vllm_rocm_c(notes: list[str]) -> None:
    """Load vLLM's _rocm_C extension library (not the vllm package) if installed."""
    if lookup_op("_rocm_C", "gptq_gemm_rdna3") is not None:
        return
    if torch.version.hip is None:
        return  # _rocm_C only exists in vLLM's ROCm builds
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        notes.append("vLLM not installed (no _rocm_C)")
        return
    libs = [p for d in spec.submodule_search_locations for p in glob.glob(os.path.join(d, "_rocm_C*.so"))]
    if not libs:
        notes.append("vLLM installed without _rocm_C*.so")
    for lib in libs:
        _load_library(lib, notes)


def _sgl_kernel(notes: list[str]) -> None:
    if importlib.util.find_spec("sgl_kernel") is None:
        notes.append("sgl_kernel not installed")
        return
    try:
        import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)
    except Exception as e:  # noqa: BLE001
        notes.append(f"sgl_kernel import failed: {type(e).__name__}: {e}")


def discover(namespaces_first: Sequence[str] = ()) -> NativeDiscovery:
    """Find installed ops. `namespaces_first` are searched before the standard ones
    (tests register doubles of GPU-only ops there)."""
    out = NativeDiscovery()
    namespaces: list[str] = list(namespaces_first)
    if os.environ.get(ENV_NATIVE, "1") != "0":
        user_lib = os.environ.get(ENV_OPS)
        if user_lib and _load_library(user_lib, out.notes):
            namespaces.append("sglang_l3")  # where our own native kernel registers
        _vllm_rocm_c(out.notes)
        _sgl_kernel(out.notes)
        namespaces += ["sglang_l3", "_rocm_C", "sgl_kernel"]
    else:
        out.notes.append(f"{ENV_NATIVE}=0: native ops not probed")
    for ns in dict.fromkeys(namespaces):
        fn = lookup_op(ns, "gptq_gemm_rdna3")
        if fn is not None:
            op, why = probe_schema(f"{ns}::gptq_gemm_rdna3", fn)
            if op is None:
                out.notes.append(why or "")
                continue
            wmma = None
            wfn = lookup_op(ns, "gptq_gemm_rdna3_wmma")
            if wfn is not None:
                wmma, why = probe_schema(f"{ns}::gptq_gemm_rdna3_wmma", wfn)
                if wmma is None:
                    out.notes.append(why or "")
                elif wmma.roles != op.roles:
                    out.notes.append(f"{ns}: wmma variant schema differs, not used")
                    wmma = None
            out.rdna3.append((op, wmma))
    for ns in dict.fromkeys(namespaces):
        if ns == "sgl_kernel" or ns in namespaces_first:
            fn = lookup_op(ns, "gptq_gemm")
            if fn is not None and out.sgl_gemm is None:
                op, why = probe_schema(f"{ns}::gptq_gemm", fn)
                if op is None:
                    out.notes.append(why or "")
                else:
                    out.sgl_gemm = op
                    out.sgl_shuffle = lookup_op(ns, "gptq_shuffle")
    if not out.rdna3:
        out.notes.append("no gptq_gemm_rdna3 op found")
    return out


@lru_cache(maxsize=1)
def installed() -> NativeDiscovery:
    return discover()


class NativeRdna3Kernel(GemmKernel):
    """vLLM's RDNA3 W4A16 op: ExLlama-shuffled 4-bit weights, zeros as stored."""

    def __init__(self, op: NativeOp, wmma: NativeOp | None = None):
        self.op, self.wmma = op, wmma
        self.name = f"native:{op.qualname}" + ("+wmma" if wmma else "")

    def unavailable(self, layer, dtype, dev):
        if not dev.hip or dev.arch not in NATIVE_ARCHS:
            return f"arch {dev.arch or 'n/a'} (gfx1100 only)"
        if layer.bits != 4:
            return f"{layer.bits}-bit (4-bit only)"
        if not layer.symmetric:
            return "asymmetric zeros (symmetric only)"
        if layer.channelwise:
            return "channel-wise (group > 0 only)"
        if layer.g_idx is not None:
            return "act-order groups not contiguous in this shard"
        if layer.N % 8:
            return f"N={layer.N} not a multiple of 8"
        if layer.K % layer.group_size:
            return f"K={layer.K} not a multiple of group {layer.group_size}"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"activation dtype {dtype}"
        return None

    def prepare(self, layer, dtype):
        qw = ref.exllama_shuffle_4bit(layer.qweight)
        if self.op.takes_v2:
            qz, v2 = layer.qzeros, layer.fmt == "v2"
        else:  # schema without the flag: the kernel adds 1 (v1)
            qz, v2 = ref.convert_zero_format(layer.qzeros, 4, layer.fmt, "v1"), False
        s = layer.scales.to(dtype).contiguous()
        empty = torch.empty(0, dtype=torch.int32, device=qw.device)
        op, wmma = self.op, self.wmma

        def run(x: torch.Tensor) -> torch.Tensor:
            use = wmma if (wmma is not None and x.shape[0] >= 16) else op
            return use.call(x, qw, qz, s, empty, v2=v2, shuffle=True, bits=4)

        return Prepared(run, {"qweight": qw, "qzeros": qz, "scales": s})


class SglKernelGemm(GemmKernel):
    """sgl_kernel::gptq_gemm(a, q, zeros, scales, g_idx, use_shuffle, bit): fp16, v1 zeros."""

    def __init__(self, op: NativeOp, shuffle: Any | None):
        self.op, self.shuffle = op, shuffle
        self.name = f"native:{op.qualname}"

    def unavailable(self, layer, dtype, dev):
        if dev.type != "cuda":
            return f"device type {dev.type}"
        if dtype != torch.float16:
            return f"activation dtype {dtype} (fp16 only)"
        if layer.fmt == "v2" and not self.op.takes_v2:
            z = ref.zero_points(layer.qzeros, layer.bits, "v2")
            if bool((z == 0).any()):
                return "v2 zero point 0 not representable in v1"
        return None

    def prepare(self, layer, dtype):
        v2 = self.op.takes_v2 and layer.fmt == "v2"
        qz = (
            layer.qzeros
            if v2 or layer.fmt == "v1"
            else ref.convert_zero_format(layer.qzeros, layer.bits, layer.fmt, "v1")
        )
        qw = layer.qweight.clone()
        use_shuffle = self.shuffle is not None and layer.g_idx is None
        if use_shuffle:
            empty = torch.empty(0, dtype=torch.int32, device=qw.device)
            self.shuffle(qw, empty, layer.bits)  # in place
            g = empty
        else:  # the non-shuffled path reads g_idx per row
            g = layer.g_idx_or_sequential().contiguous()
        s, op, bits = layer.scales.to(dtype).contiguous(), self.op, layer.bits
        return Prepared(
            lambda x: op.call(x, qw, qz, s, g, v2=v2, shuffle=use_shuffle, bits=bits),
            {"qweight": qw, "qzeros": qz, "scales": s, "g_idx": g},
        )


def candidates(found: NativeDiscovery | None = None) -> list[GemmKernel]:
    found = installed() if found is None else found
    out: list[GemmKernel] = [NativeRdna3Kernel(op, w) for op, w in found.rdna3]
    if found.sgl_gemm is not None:
        out.append(SglKernelGemm(found.sgl_gemm, found.sgl_shuffle))
    return out + [TritonKernel(), TorchKernel()]


# --------------------------------------------------------------------------- #
# Preparing a layer and choosing its kernel
# --------------------------------------------------------------------------- #
def pack_layer(
    ck: Checkpoint, *, bits: int, group_size: int, desc_act: bool, declared: ZeroFormat
) -> tuple[PackedLayer, ref.FormatDecision]:
    """Detect the zero format and sort act-order rows once (K permutation)."""
    K = ck.qweight.shape[0] * 32 // bits
    N = ck.qweight.shape[1]
    decision = ref.detect_zero_format(ck.qzeros, bits, declared)
    channelwise = group_size <= 0
    gs = K if channelwise else group_size
    qweight, g_idx, perm = ck.qweight, None, None
    # Without desc_act the groups are k // group_size by construction; the loaded
    # g_idx is ignored (on a row-parallel shard it holds global group ids while
    # the scales are already sliced to this shard).
    if desc_act and not channelwise and ck.g_idx is not None and not ref.is_sequential(ck.g_idx, gs):
        qweight, g_sorted, perm = ref.sort_by_group(ck.qweight, ck.g_idx, bits)
        g_idx = None if ref.is_sequential(g_sorted, gs) else g_sorted.to(torch.int32)
    layer = PackedLayer(
        qweight=qweight.contiguous(),
        qzeros=ck.qzeros.contiguous(),
        scales=ck.scales.contiguous(),
        g_idx=g_idx,
        perm=perm,
        bits=bits,
        group_size=gs,
        fmt=decision.fmt,
        symmetric=decision.symmetric,
        K=K,
        N=N,
        channelwise=channelwise,
    )
    return layer, decision


class LayerGemm:
    """The callable a layer uses at run time: permute x (act-order), run the kernel."""

    def __init__(self, runner: Runner, perm: torch.Tensor | None, n: int, kernel: str):
        self.runner, self.perm, self.n, self.kernel = runner, perm, n, kernel
        if perm is not None:
            self.perm = perm.to(torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        return self.runner(x2.contiguous()).reshape(*x.shape[:-1], self.n)


def self_check(
    gemm: LayerGemm,
    ck: Checkpoint,
    *,
    bits: int,
    fmt: ZeroFormat,
    group_size: int,
    act_order: bool,
    dtype: torch.dtype,
    m_values: Sequence[int] = CHECK_MS,
    max_cols: int = 64,
) -> ref.Comparison:
    """Run the layer's kernel on a slice of the real layer and compare with the fp32
    reference built from the checkpoint tensors and the load-time decisions (zero
    format, act-order), never from anything a kernel's prepare() produced.
    One M per Triton launch shape. Returns the first failure, else the worst."""
    device = ck.qweight.device
    k, n = ck.qweight.shape[0] * 32 // bits, ck.qweight.shape[1]
    cols = torch.linspace(0, n - 1, steps=min(n, max_cols), device=device).round().long().unique()
    if act_order and ck.g_idx is not None:
        g = ck.g_idx
    else:  # sequential groups (or channel-wise: group_size == K)
        g = torch.arange(k, device=device, dtype=torch.int32) // group_size
    w = ref.dequantize(ck.qweight, ck.qzeros, ck.scales, g, bits, fmt, cols=cols)
    results = []
    for m in m_values:
        x = ref.check_inputs(m, k, dtype, device, seed=1234 + m)
        results.append(ref.compare(gemm(x)[:, cols], x.float() @ w, dtype))
    failed = [c for c in results if not c.ok]
    return failed[0] if failed else max(results, key=lambda c: c.rel_l2)


@dataclass
class Selection:
    gemm: LayerGemm
    kernel: str
    fmt: ZeroFormat
    fmt_reason: str
    check: ref.Comparison
    skipped: list[tuple[str, str]]  # (kernel, reason) in order tried
    tensors: dict[str, torch.Tensor]  # the kernel's weights (the layer keeps only these)
    act_order: bool


_DECISIONS: list[dict[str, Any]] = []
_DLOCK = threading.Lock()


def decisions() -> list[dict[str, Any]]:
    with _DLOCK:
        return list(_DECISIONS)


def record_decision(entry: dict[str, Any]) -> None:
    with _DLOCK:
        _DECISIONS.append(entry)


def select(
    ck: Checkpoint,
    *,
    bits: int,
    group_size: int,
    desc_act: bool,
    declared: ZeroFormat,
    dtype: torch.dtype,
    prefix: str = "",
    dev: DeviceInfo | None = None,
    kernels: Sequence[GemmKernel] | None = None,
) -> Selection:
    """Choose and verify the kernel for one layer. Raises if none reproduces the reference."""
    dev = dev or device_info(ck.qweight.device)
    layer, decision = pack_layer(ck, bits=bits, group_size=group_size, desc_act=desc_act, declared=declared)
    if layer.scales.dtype != dtype:
        layer.scales = layer.scales.to(dtype)
    if decision.fmt != declared:
        logger.warning("sglang-l3 GPTQ %s: %s", prefix or "<layer>", decision.reason)
    skipped: list[tuple[str, str]] = []
    truth: dict[str, Any] = dict(
        bits=bits, fmt=decision.fmt, group_size=layer.group_size, act_order=layer.perm is not None, dtype=dtype
    )
    for kernel in candidates() if kernels is None else kernels:
        why = kernel.unavailable(layer, dtype, dev)
        if why:
            skipped.append((kernel.name, why))
            continue
        try:
            prepared = kernel.prepare(layer, dtype)
            gemm = LayerGemm(prepared.run, layer.perm, layer.N, kernel.name)
            check = self_check(gemm, ck, **truth)
        except Exception as e:  # noqa: BLE001 - a kernel that raises is skipped, loudly
            logger.error(
                "sglang-l3 GPTQ %s: kernel %s raised during its load-time self-check (%s: %s); trying the next kernel",
                prefix or "<layer>",
                kernel.name,
                type(e).__name__,
                e,
            )
            skipped.append((kernel.name, f"self-check raised {type(e).__name__}: {e}"))
            continue
        if not check.ok:
            logger.error(
                "sglang-l3 GPTQ %s: kernel %s FAILED its load-time self-check against "
                "the torch reference (%s; bits=%d fmt=%s dtype=%s); falling back to the "
                "next kernel",
                prefix or "<layer>",
                kernel.name,
                check,
                bits,
                decision.fmt,
                dtype,
            )
            skipped.append((kernel.name, f"self-check mismatch: {check}"))
            continue
        sel = Selection(
            gemm, kernel.name, decision.fmt, decision.reason, check, skipped, prepared.tensors, layer.perm is not None
        )
        record_decision(
            {
                "prefix": prefix,
                "bits": bits,
                "fmt": decision.fmt,
                "dtype": str(dtype),
                "group_size": group_size,
                "act_order": layer.perm is not None,
                "kernel": kernel.name,
                "fmt_reason": decision.reason,
                "check": str(check),
                "skipped": skipped,
            }
        )
        return sel
    raise RuntimeError(
        f"sglang-l3 GPTQ {prefix or '<layer>'}: no kernel reproduces the reference "
        f"(bits={bits} fmt={decision.fmt} dtype={dtype}); tried: " + "; ".join(f"{k}: {r}" for k, r in skipped)
    )


def plan(
    bits: int,
    fmt: ZeroFormat,
    dtype: torch.dtype,
    dev: DeviceInfo,
    *,
    group_size: int = 128,
    symmetric: bool = True,
    K: int = 4096,
    N: int = 4096,
    kernels: Sequence[GemmKernel] | None = None,
) -> list[tuple[str, str | None]]:
    """Which kernels could serve a typical layer of this kind, and why the others
    cannot (no weights, no self-check: the doctor's view)."""
    layer = PackedLayer(
        qweight=torch.empty(0, N, dtype=torch.int32),
        qzeros=torch.empty(0, N * bits // 32, dtype=torch.int32),
        scales=torch.empty(0, N, dtype=dtype),
        g_idx=None,
        perm=None,
        bits=bits,
        group_size=group_size if group_size > 0 else K,
        fmt=fmt,
        symmetric=symmetric,
        K=K,
        N=N,
        channelwise=group_size <= 0,
    )
    out = []
    for k in candidates() if kernels is None else kernels:
        try:
            why = k.unavailable(layer, dtype, dev)
        except Exception as e:  # noqa: BLE001 - e.g. a check that needs real zeros
            why = f"needs the layer's weights to decide ({type(e).__name__})"
        out.append((k.name, why))
    return out
