"""Store settings: `--hicache-storage-backend-extra-config` JSON, then env, then defaults.

Precedence for every setting: extra_config key > SGLANG_L3_STORE_* env >
upstream's SGLANG_HICACHE_FILE_BACKEND_* env (kept working) > default.
Torch- and sglang-free so the CLI starts instantly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_l3.storage.safety import IDENTITY_OVERRIDE_RE

DURABILITY_MODES = ("none", "batch")
ODIRECT_MODES = ("auto", "on", "off")

_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IEC = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
# Units are case-insensitive (1kib = 1KiB = 1024); a trailing B is optional.
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?", re.IGNORECASE)
SIZE_EXAMPLES = "200G, 1.5T, 180Gi, 1kib, 1073741824, 5%"


class ConfigError(ValueError):
    """A setting has a value we cannot use; the message names the setting."""


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(value: Any, *, name: str = "size", fs_total: int | None = None, strict: bool = False) -> int:
    """'20G' (SI, like upstream's human_readable_int), '20Gi'/'20GiB'/'20gib'
    (IEC), plain bytes, or 'N%' of the filesystem (needs fs_total).
    Settings: 0 / '' / None = off. strict=True (destructive CLI values): empty,
    fractional byte counts ('0.5'), negatives and unknown units are errors."""
    if value is None or (isinstance(value, str) and not value.strip()):
        if strict:
            raise ConfigError(f"{name}: empty size (examples: {SIZE_EXAMPLES})")
        return 0
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{name}: negative size {value!r}")
        if strict and value != int(value):
            raise ConfigError(f"{name}: {value!r} is not a whole number of bytes")
        return int(value)
    s = str(value).strip()
    if s.startswith("-"):
        raise ConfigError(f"{name}: negative size {s!r} (examples: {SIZE_EXAMPLES})")
    if s.endswith("%"):
        if fs_total is None:
            raise ConfigError(f"{name}: a percentage needs a filesystem, got {s!r}")
        try:
            pct = float(s[:-1])
        except ValueError as e:
            raise ConfigError(f"{name}: bad percentage {s!r} (examples: {SIZE_EXAMPLES})") from e
        if not 0 <= pct <= 100:
            raise ConfigError(f"{name}: percentage out of range: {s!r}")
        return int(fs_total * pct / 100)
    m = _SIZE_RE.fullmatch(s)
    if not m:
        raise ConfigError(f"{name}: cannot parse size {s!r} (examples: {SIZE_EXAMPLES})")
    number, suffix = m.groups()
    unit = _IEC[suffix.lower()] if suffix and suffix.lower() in _IEC else _SI[suffix.lower()] if suffix else 1
    if strict and not suffix and "." in number:
        raise ConfigError(
            f"{name}: {s!r} is not a whole number of bytes; give a unit or a percentage (examples: {SIZE_EXAMPLES})"
        )
    return int(float(number) * unit)


def default_store_dir() -> Path:
    """Under the user's cache directory (XDG), never /tmp."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang-l3" / "store"


@dataclass(frozen=True)
class StoreSettings:
    root: Path
    max_bytes: int = 0  # whole store for this server (split across its ranks); 0 = no cap
    min_free: str = "5%"  # free-space floor on the filesystem (bytes or N%)
    durability: str = "none"
    odirect: str = "auto"
    io_threads: int = 32
    eviction_ratio: float = 0.9
    quarantine_max_bytes: int = 2 * 2**30
    model_identity: str = ""  # operator override mixed into the model identity

    def min_free_bytes(self, fs_total: int | None) -> int:
        return parse_size(self.min_free, name="min_free_bytes", fs_total=fs_total or 0)

    @classmethod
    def resolve(
        cls,
        extra_config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        explicit_dir: str | None = None,
    ) -> StoreSettings:
        extra = dict(extra_config or {})
        env = os.environ if env is None else env

        def pick(keys: tuple[str, ...], envs: tuple[str, ...], default: Any) -> Any:
            for k in keys:
                if extra.get(k) not in (None, ""):
                    return extra[k]
            for e in envs:
                if env.get(e) not in (None, ""):
                    return env[e]
            return default

        root = pick(
            ("store_dir", "file_storage_path"),
            ("SGLANG_L3_STORE_DIR", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"),
            explicit_dir or default_store_dir(),
        )
        max_bytes = parse_size(
            pick(("max_bytes", "max_size"), ("SGLANG_L3_STORE_MAX_BYTES", "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"), 0),
            name="max_bytes",
        )
        min_free = pick(
            ("min_free_bytes", "min_free_space"),
            ("SGLANG_L3_STORE_MIN_FREE_BYTES", "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE"),
            "5%",
        )
        if isinstance(min_free, str) and min_free.strip() == "0":
            min_free = 0
        parse_size(min_free, name="min_free_bytes", fs_total=1)  # validate early
        durability = str(pick(("durability",), ("SGLANG_L3_STORE_DURABILITY",), "none")).lower()
        if durability not in DURABILITY_MODES:
            raise ConfigError(f"durability must be one of {DURABILITY_MODES}, got {durability!r}")
        odirect = pick(("odirect",), ("SGLANG_L3_STORE_ODIRECT",), "auto")
        odirect = {True: "on", False: "off", "1": "on", "0": "off", "true": "on", "false": "off"}.get(
            odirect if isinstance(odirect, bool) else str(odirect).lower(), str(odirect).lower()
        )
        if odirect not in ODIRECT_MODES:
            raise ConfigError(f"odirect must be one of {ODIRECT_MODES}, got {odirect!r}")
        try:
            threads = int(pick(("io_threads",), ("SGLANG_L3_STORE_IO_THREADS",), 32))
            ratio = float(
                pick(
                    ("eviction_ratio",),
                    ("SGLANG_L3_STORE_EVICTION_RATIO", "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO"),
                    0.9,
                )
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"io_threads / eviction_ratio: {e}") from e
        if not 1 <= threads <= 256:
            raise ConfigError(f"io_threads must be in 1..256, got {threads}")
        if not 0.0 < ratio <= 1.0:
            ratio = 0.9
        override = str(pick(("model_identity",), ("SGLANG_L3_STORE_MODEL_IDENTITY",), ""))
        if not IDENTITY_OVERRIDE_RE.fullmatch(override):
            raise ConfigError(f"model_identity must match [A-Za-z0-9_.:@+=-]{{0,128}}, got {override!r}")
        qmax = parse_size(extra.get("quarantine_max_bytes", 2 * 2**30), name="quarantine_max_bytes")
        return cls(
            root=Path(str(root)).expanduser(),
            max_bytes=max_bytes,
            min_free=min_free if isinstance(min_free, str) else str(int(min_free)),
            durability=durability,
            odirect=odirect,
            io_threads=threads,
            eviction_ratio=ratio,
            quarantine_max_bytes=qmax,
            model_identity=override,
        )
