"""The house's layering, read from the source (ast): runtime modules (what a
serving process imports) never import the harnesses (sglang_l3.testing) or test
code, nothing below patches/ imports upward (patches, plugin, cli, doctor), and a
patch never reaches into a command-line module (shared logic lives where both can
import it publicly)."""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_l3

PKG = Path(sglang_l3.__file__).resolve().parent
HARNESS = ("sglang_l3.testing",)
TEST_CODE = ("test", "tests", "conftest", "l3_e2e", "kit_shims", "fake_patch_target", "pytest")
# Packages below patches/: they provide what patches install and must not reach up.
BELOW = (
    "sglang_l3.storage",
    "sglang_l3.quant",
    "sglang_l3.cpu",
    "sglang_l3.cpu_serving",
    "sglang_l3.metrics",
    "sglang_l3.envs",
    "sglang_l3.device_reads",
)
UPPER = ("sglang_l3.patches", "sglang_l3.plugin", "sglang_l3.cli", "sglang_l3.doctor")
# command-line modules: a runtime patch imports none of them
CLI = ("sglang_l3.cli", "sglang_l3.storage.cli", "sglang_l3.storage.sessions_cli")
# storage's tool layer: the doctor section reads the store, it does not run the CLI
EXTRA = {"sglang_l3.storage.doctor": ("sglang_l3.storage.cli",)}


def _modname(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement names (absolute; relative resolved)."""
    mod = _modname(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]  # `from pkg import mod`
    return out


def runtime_modules() -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py")) if not _under(_modname(p), HARNESS)]


def violations() -> list[str]:
    bad: list[str] = []
    for path in runtime_modules():
        mod = _modname(path)
        for line, name in imports_of(path):
            where = f"{path.relative_to(PKG.parent)}:{line}"
            if _under(name, HARNESS) or name.split(".")[0] in TEST_CODE:
                bad.append(f"{where}: runtime module {mod} imports harness/test code {name}")
            if _under(mod, BELOW) and _under(name, UPPER):
                bad.append(f"{where}: {mod} (below patches/) imports {name}")
            if _under(mod, ("sglang_l3.patches",)) and _under(name, CLI):
                bad.append(f"{where}: patch {mod} imports command-line module {name}")
            if _under(name, EXTRA.get(mod, ())):
                bad.append(f"{where}: {mod} imports {name}")
    return bad


def test_runtime_modules_found() -> None:
    names = {_modname(p) for p in runtime_modules()}
    assert {
        "sglang_l3.plugin",
        "sglang_l3.patches.framework",
        "sglang_l3.storage.backend",
        "sglang_l3.quant.doctor",
        "sglang_l3.cpu",
        "sglang_l3.metrics",
    } <= names
    assert not any(_under(n, HARNESS) for n in names)


def test_no_runtime_module_imports_harness_or_reaches_upward() -> None:
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path) -> None:
    """The walker catches both shapes of import (negative control of the check)."""
    p = PKG / "quant" / "_layering_probe.py"
    p.write_text("from sglang_l3.patches import framework\nimport sglang_l3.testing.stack\n")
    q = PKG / "patches" / "_layering_probe.py"
    q.write_text("from sglang_l3.storage.sessions_cli import run\n")
    try:
        found = violations()
    finally:
        p.unlink()
        q.unlink()
    assert any("_layering_probe.py:1" in v and "below patches/" in v for v in found)
    assert any("_layering_probe.py:2" in v and "harness" in v for v in found)
    assert any("patches/_layering_probe.py:1" in v and "command-line module" in v for v in found)
