"""Who wrote a page: model, weights, dtypes, layout, page size, parallel shard.

Upstream's file backend keys pages on the served model name and TP rank only
("TODO: Include KV dtype and stored layout in keys", hicache_storage.py ~761),
so a bf16-written store read with fp16 KV restores wrong KV. Here every page
carries three identities, all checked on read (a mismatch is a miss):

- ModelIdentity: rank-independent facts (model config + weights, quantization,
  dtypes, page size, layout, parallel sizes, format version) -> `mid` digest.
- Shard: this process's rank coordinates (TP/PP/CP/DCP) -> `shard` name.
- PoolLayout: one host pool's page bytes (dtype + shape of each component,
  layout, tokens per page) -> `pool digest`.

`identity_for(storage_config, server_args=None)` is the reusable entry point
(issue 7): it takes upstream's HiCacheStorageConfig and, when available, the
published ServerArgs. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _digest(obj: Any, n: int) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


@dataclass(frozen=True)
class ModelIdentity:
    model: str = ""
    model_config: str = "unknown"  # sha256[:16] of config.json
    weights: str = "unknown"  # hub revision, or a fingerprint of the weight files
    quantization: str = "none"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    mamba_ssm_dtype: str = "auto"
    load_format: str = "auto"
    page_size: int = 0
    mem_layout: str = ""
    tp_size: int = 1
    pp_size: int = 1
    attn_cp_size: int = 1
    dcp_size: int = 1
    is_mla: bool = False
    override: str = ""
    format_version: int = FORMAT_VERSION

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        return _digest(self.as_dict(), 12)


@dataclass(frozen=True)
class Shard:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1

    def name(self, *, replicated: bool = False) -> str:
        """`r0of2`; `rall` for TP-replicated pools (MLA KV)."""
        s = "rall" if replicated else f"r{self.tp_rank}of{self.tp_size}"
        if self.pp_size > 1:
            s += f"p{self.pp_rank}of{self.pp_size}"
        if self.cp_size > 1:
            s += f"c{self.cp_rank}of{self.cp_size}"
        if self.dcp_size > 1:
            s += f"d{self.dcp_rank}of{self.dcp_size}"
        return s


@dataclass(frozen=True)
class PoolLayout:
    pool: str
    layout: str
    page_size: int  # tokens per page (1 for Mamba state slots)
    components: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) in payload order
    payload_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "layout": self.layout,
            "page_size": self.page_size,
            "components": [[d, list(s)] for d, s in self.components],
            "payload_bytes": self.payload_bytes,
        }

    def digest(self) -> str:
        return _digest(self.as_dict(), 8)

    @property
    def element_count(self) -> int:
        n = 0
        for _, shape in self.components:
            c = 1
            for d in shape:
                c *= d
            n += c
        return n


def diff(expected: dict, found: dict, prefix: str = "") -> list[str]:
    """Human-readable field differences (for logs and quarantine reasons)."""
    out = []
    for k in sorted(set(expected) | set(found)):
        a, b = expected.get(k), found.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: expected {a!r}, page has {b!r}")
    return out


# --------------------------------------------------------------------------- #
# Model fingerprint (no network; best effort, "unknown" when not derivable)
# --------------------------------------------------------------------------- #
def _file_sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def _weights_of_dir(d: Path) -> str:
    """Names and sizes of weight files plus the shard index: cheap, and changes
    whenever a checkpoint is re-quantized or replaced (hashing 50 GB is not)."""
    entries = []
    try:
        for p in sorted(d.iterdir()):
            if p.name.endswith(_WEIGHT_SUFFIXES) or p.name.endswith(".index.json"):
                try:
                    st = p.stat()
                except OSError:
                    continue
                sha = _file_sha(p) if p.name.endswith(".index.json") else None
                entries.append([p.name, st.st_size, sha])
    except OSError:
        return "unknown"
    return "files:" + _digest(entries, 16) if entries else "unknown"


def _hub_snapshot(model: str, revision: str | None) -> tuple[str, Path] | None:
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"),
        "hub",
    )
    repo = Path(hub) / ("models--" + model.replace("/", "--"))
    ref = revision or "main"
    commit = ref
    ref_file = repo / "refs" / ref
    try:
        commit = ref_file.read_text().strip()
    except OSError:
        if not (repo / "snapshots" / ref).is_dir():
            return None
    snap = repo / "snapshots" / commit
    return (commit, snap) if snap.is_dir() else None


def model_fingerprint(model_path: str, revision: str | None = None) -> tuple[str, str]:
    """(config hash, weights id) for a local directory or a cached hub model."""
    if not model_path:
        return "unknown", "unknown"
    p = Path(model_path).expanduser()
    if p.is_dir():
        return _file_sha(p / "config.json") or "unknown", _weights_of_dir(p)
    snap = _hub_snapshot(model_path, revision)
    if snap is not None:
        commit, d = snap
        return _file_sha(d / "config.json") or "unknown", f"rev:{commit}"
    return "unknown", f"rev:{revision}" if revision else "unknown"


def _server_args() -> Any:
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # not published (unit tests, CLI) or API changed
        return None


def _s(v: Any, default: str) -> str:
    if v is None or v == "":
        return default
    return str(v).replace("torch.", "")


def identity_for(storage_config: Any, server_args: Any = None, *, override: str = "") -> tuple[ModelIdentity, Shard]:
    """ModelIdentity + Shard from upstream's HiCacheStorageConfig (+ ServerArgs).

    Everything that changes the bytes of a page or which rank owns them goes
    in; anything that does not (ports, batch sizes) stays out so restarts keep
    their pages.
    """
    sa = server_args if server_args is not None else _server_args()
    g = (lambda name, d=None: getattr(sa, name, d)) if sa is not None else (lambda name, d=None: d)
    model_path = g("model_path") or ""
    cfg_hash, weights = model_fingerprint(model_path, g("revision"))
    if g("load_format") == "dummy":
        weights = f"dummy:seed={g('random_seed')}"
    cfg = storage_config
    model = ModelIdentity(
        model=_s(getattr(cfg, "model_name", None) or model_path, ""),
        model_config=cfg_hash,
        weights=weights,
        quantization=_s(g("quantization"), "none"),
        dtype=_s(g("dtype"), "auto"),
        kv_cache_dtype=_s(g("kv_cache_dtype"), "auto"),
        mamba_ssm_dtype=_s(g("mamba_ssm_dtype"), "auto"),
        load_format=_s(g("load_format"), "auto"),
        page_size=int(g("page_size") or 0),
        mem_layout=_s(g("hicache_mem_layout"), ""),
        tp_size=int(getattr(cfg, "tp_size", 1)),
        pp_size=int(getattr(cfg, "pp_size", 1)),
        attn_cp_size=int(getattr(cfg, "attn_cp_size", 1)),
        dcp_size=int(getattr(cfg, "dcp_size", 1)),
        is_mla=bool(getattr(cfg, "is_mla_model", False)),
        override=override,
    )
    shard = Shard(
        tp_rank=int(getattr(cfg, "tp_rank", 0)),
        tp_size=int(getattr(cfg, "tp_size", 1)),
        pp_rank=int(getattr(cfg, "pp_rank", 0)),
        pp_size=int(getattr(cfg, "pp_size", 1)),
        cp_rank=int(getattr(cfg, "attn_cp_rank", 0)),
        cp_size=int(getattr(cfg, "attn_cp_size", 1)),
        dcp_rank=int(getattr(cfg, "dcp_rank", 0)),
        dcp_size=int(getattr(cfg, "dcp_size", 1)),
    )
    return model, shard
