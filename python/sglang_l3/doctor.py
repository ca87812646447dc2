"""`sglang-l3 doctor`: is this installation what sglang-l3 expects?

Versions, platform, plugin discovery, the radix-tree core against this torch,
every patch's state (applied / disabled /
drifted / not applicable / failed — found by actually running the queue in this
process, not assumed), the L3 store directory, and subsystem reports
(storage, quantization) where those modules are installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import platform
import stat
from dataclasses import dataclass, field
from typing import Any

from sglang_l3 import SGLANG_PIN, __version__

# Subsystems that contribute a section: module exposing report(**kw) -> dict
# {"ok": bool, "lines": [...], "data": {...}}. Missing modules are skipped.
SECTIONS = (
    ("storage", "sglang_l3.storage.doctor"),
    ("quantization", "sglang_l3.quant.doctor"),
)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_versions() -> Check:
    vers = {d: _version(d) for d in ("sglang", "torch", "triton", "sglang-l3")}
    ok = vers["sglang"] == SGLANG_PIN
    detail = ", ".join(f"{k} {v or 'missing'}" for k, v in vers.items())
    if not ok:
        detail += f" — sglang-l3 {__version__} is pinned to sglang=={SGLANG_PIN}"
    return Check("versions", ok, detail, vers)


def detect_platform() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch

        if torch.version.hip is not None and torch.cuda.is_available():
            kind = "rocm"
        elif torch.cuda.is_available():
            kind = "cuda"
        else:
            kind = "cpu"
        info["kind"] = kind
        info["torch_hip"] = torch.version.hip
        info["torch_cuda"] = torch.version.cuda
        if kind != "cpu":
            n = torch.cuda.device_count()
            devs = []
            for i in range(n):
                p = torch.cuda.get_device_properties(i)
                devs.append({"name": p.name, "arch": getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"})
            info["devices"] = devs
    except Exception as e:  # torch broken is itself a finding
        info["kind"] = "unknown"
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def check_platform() -> Check:
    info = detect_platform()
    devs = info.get("devices") or []
    arch = ", ".join(f"{d['name']} ({d['arch']})" for d in devs) or "no GPU"
    return Check("platform", info.get("kind") != "unknown", f"{info.get('kind')}: {arch}", info)


def check_plugin() -> Check:
    eps = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.value.startswith("sglang_l3.")]
    allowed = os.environ.get("SGLANG_PLUGINS")
    visible = bool(eps) and (not allowed or any(ep.name in allowed.split(",") for ep in eps))
    detail = (
        f"entry point {eps[0].name} = {eps[0].value}" if eps else "sglang-l3 entry point not found (pip install -e .)"
    )
    if eps and not visible:
        detail += f"; excluded by SGLANG_PLUGINS={allowed}"
    return Check("plugin", visible, detail, {"entry_points": [f"{e.name}={e.value}" for e in eps]})


def check_patches() -> Check:
    from sglang_l3.patches import framework

    statuses = framework.apply_all(strict=False)
    rows = [s.as_dict() for s in statuses]
    bad = [s for s in statuses if s.state in (framework.State.DRIFTED, framework.State.FAILED)]
    detail = ", ".join(f"{s.spec.id}: {s.state.value}" for s in statuses)
    return Check("patches", not bad, detail, {"patches": rows})


def check_tree_core() -> Check:
    """The radix-tree core a server would run here, and whether it matches this torch."""
    from sglang_l3 import tree_core

    try:
        selected = tree_core.selected_core()
        why = tree_core.rust_core_mismatch()
    except Exception as e:  # sglang or torch missing: check_versions says so
        return Check("tree core", False, f"cannot tell: {type(e).__name__}: {e}")
    data = {"selected": selected, "rust_mismatch": why}
    if why is None:
        return Check("tree core", True, f"{selected} (the Rust core matches this torch)", data)
    if selected == "python":
        return Check("tree core", True, f"python ({why})", data)
    return Check(
        "tree core",
        False,
        f"{selected}: {why}, and it panics there; set {tree_core.ENV}=python (the tests use the Python core)",
        data,
    )


def store_dir_from_env() -> str:
    for var in ("SGLANG_L3_STORE_DIR", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
        if os.environ.get(var):
            return os.environ[var]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang-l3", "store")


def check_store_dir(path: str | None = None) -> Check:
    """Basic health of the store directory (the storage section adds contents)."""
    path = path or store_dir_from_env()
    data: dict[str, Any] = {"path": path}
    if not os.path.exists(path):
        return Check("store", True, f"{path}: not created yet (created 0700 on first use)", data)
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    fs = os.statvfs(path)
    data.update(owner_uid=st.st_uid, mode=oct(mode), free_bytes=fs.f_bavail * fs.f_frsize)
    problems = []
    if not stat.S_ISDIR(st.st_mode):
        problems.append("not a directory")
    if st.st_uid != os.geteuid():
        problems.append(f"owned by uid {st.st_uid}, not {os.geteuid()}")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"group/world-writable ({oct(mode)})")
    ok = not problems
    free_gib = data["free_bytes"] / 2**30
    detail = f"{path}: mode {oct(mode)}, {free_gib:.1f} GiB free" + ("; " + "; ".join(problems) if problems else "")
    return Check("store", ok, detail, data)


def check_sections(store_dir: str | None) -> list[Check]:
    out = []
    for name, modname in SECTIONS:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        try:
            rep = mod.report(store_dir=store_dir) if name == "storage" else mod.report()
        except Exception as e:
            out.append(Check(name, False, f"report failed: {type(e).__name__}: {e}"))
            continue
        out.append(Check(name, bool(rep.get("ok", False)), "; ".join(rep.get("lines", [])), rep.get("data", {})))
    return out


def stats() -> dict[str, Any]:
    """Counters published by running SGLang processes (summed over TP ranks),
    plus this process's own."""
    from sglang_l3 import metrics

    out: dict[str, Any] = dict(metrics.collect_published(exclude_pid=os.getpid()))
    for k, v in metrics.snapshot().items():
        out[k] = out.get(k, 0) + v
    return out


def run(store_dir: str | None = None, with_stats: bool = False) -> tuple[bool, list[Check]]:
    checks = [
        check_versions(),
        check_platform(),
        check_plugin(),
        check_tree_core(),
        check_patches(),
        check_store_dir(store_dir),
    ]
    checks += check_sections(store_dir)
    if with_stats:
        checks.append(Check("stats", True, "counters", stats()))
    return all(c.ok for c in checks), checks


def render(ok: bool, checks: list[Check], as_json: bool) -> str:
    if as_json:
        return json.dumps(
            {"ok": ok, "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail, "data": c.data} for c in checks]},
            indent=2,
            default=str,
        )
    lines = []
    for c in checks:
        lines.append(f"[{'ok' if c.ok else 'FAIL':>4}] {c.name:13s} {c.detail}")
        if c.name == "patches":
            for p in c.data.get("patches", []):
                fired = ", ".join(f"{k}×{v}" for k, v in p["fired"].items())
                extra = f" — {p['detail']}" if p["detail"] else ""
                if p.get("requires"):
                    extra += f" (requires {', '.join(p['requires'])})"
                lines.append(
                    f"         - {p['id']:18s} {p['kind']:8s} {p['state']}{extra}" + (f" [{fired}]" if fired else "")
                )
        if c.name == "stats":
            for k, v in sorted(c.data.items()):
                lines.append(f"         - {k}: {v}")
    lines.append("doctor: all good" if ok else "doctor: problems found (see FAIL lines)")
    return "\n".join(lines)
