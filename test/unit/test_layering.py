"""The house's layering, read from the source (ast): runtime modules (what a
serving process imports) never import the harnesses (sglang_l3.testing) or test
code, nothing below patches/ imports upward (patches, plugin, cli, doctor), a
patch never reaches into a command-line module (shared logic lives where both can
import it publicly), the simulated device (sglang_l3.sim) is loaded only by its one
gate (the simulator imports the runtime's fault switch, never the other way round),
no modules import each other in a circle, no module imports another's underscore
names, and patches/ has one subpackage per series group."""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_l3

PKG = Path(sglang_l3.__file__).resolve().parent
HARNESS = ("sglang_l3.testing",)
# test machinery (the simulated device): not runtime; runtime reaches it only through
# this gate, which loads it only when asked (the fault switch, sglang_l3.faults, is
# runtime: the simulator imports it)
SIM = ("sglang_l3.sim",)
SIM_GATES = ("sglang_l3.patches.cpu.sim_streams",)
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
    "sglang_l3.sessions",
    "sglang_l3.faults",
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
    return [p for p in sorted(PKG.rglob("*.py")) if not _under(_modname(p), HARNESS + SIM)]


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
            if _under(name, SIM) and mod not in SIM_GATES:
                bad.append(f"{where}: runtime module {mod} imports test machinery {name}")
    return bad


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in it, function bodies too),
    over the whole package (harnesses and the simulator included). An import of a
    package a module sits in (its own `__init__`) is not an arrow."""
    mods = {_modname(p): p for p in sorted(PKG.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        for _, name in imports_of(path):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):
                graph.setdefault(mod, set()).add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other around a circle (strongly connected
    components of more than one module; Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp: list[str] = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


REPO = PKG.parent.parent
SOURCES = ("python", "test", "benchmark")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def underscore_reach_ins(roots: tuple[str, ...] = SOURCES) -> list[str]:
    """`from sglang_l3.X import _name` in another module, and (in the package)
    `alias._name` on an imported sglang_l3 module or name: each is a reach-in."""
    bad: list[str] = []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            in_pkg = PKG in path.resolve().parents
            mod = _modname(path) if in_pkg else str(path.relative_to(REPO))
            tree = ast.parse(path.read_text(), str(path))
            aliases: dict[str, str] = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith("sglang_l3") and a.asname:
                            aliases[a.asname] = a.name
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang_l3"):
                    for a in node.names:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                        if _private(a.name) and node.module != mod:
                            where = f"{path.relative_to(REPO)}:{node.lineno}"
                            bad.append(f"{where}: {mod} imports {a.name} from {node.module}")
            if not in_pkg:
                continue  # tests may reach into the module they test (monkeypatch)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and _private(node.attr)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in aliases
                ):
                    where = f"{path.relative_to(REPO)}:{node.lineno}"
                    bad.append(f"{where}: {mod} reaches into {aliases[node.value.id]}.{node.attr}")
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


def test_no_import_circle() -> None:
    """No modules import each other around a circle (issue 51: `faults` and the
    simulator's fault machinery did), function-level imports included."""
    assert circles(import_graph()) == []


def test_the_circle_check_sees_a_circle() -> None:
    """Negative control: two modules importing each other (one at module level, one in
    a function), and a runtime module importing the simulator, are both caught."""
    a = PKG / "quant" / "_layering_probe_a.py"
    b = PKG / "quant" / "_layering_probe_b.py"
    a.write_text("import sglang_l3.quant._layering_probe_b\n")
    b.write_text("def f() -> None:\n    from sglang_l3.quant import _layering_probe_a\n")
    c = PKG / "_layering_probe.py"
    c.write_text("def f() -> None:\n    from sglang_l3.sim import streams\n")
    try:
        found = circles(import_graph())
        up = violations()
    finally:
        a.unlink()
        b.unlink()
        c.unlink()
    assert ["sglang_l3.quant._layering_probe_a", "sglang_l3.quant._layering_probe_b"] in found
    assert any("sglang_l3/_layering_probe.py:2" in v and "test machinery" in v for v in up)
    assert circles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]


def test_no_module_imports_another_modules_underscore_names() -> None:
    assert underscore_reach_ins() == []


def test_patches_has_one_subpackage_per_series_group() -> None:
    """series.toml's `group` and the folder agree, and every patch module is named by
    the series (no stray module outside a group)."""
    from sglang_l3.patches.framework import load_series

    series = load_series()
    wrong = [
        f"{s.id}: group {s.group!r}, module {s.module}"
        for s in series
        if s.module.rpartition(".")[0] != f"sglang_l3.patches.{s.group.replace('-', '_')}"
    ]
    assert wrong == []
    named = {s.module for s in series}
    here = PKG / "patches"
    on_disk = {_modname(p) for p in here.rglob("*.py") if p.parent != here and p.name != "__init__.py"}
    assert on_disk == named, (sorted(on_disk - named), sorted(named - on_disk))
    assert {p.name for p in here.glob("*.py")} == {"__init__.py", "framework.py", "fingerprint.py"}
    assert {p.name for p in here.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        s.group.replace("-", "_") for s in series
    }


def module_mismatches(entries: list[dict]) -> list[str]:
    """Series entries whose module is not named for the patch: its leaf is neither the
    id nor the id without its group's prefix (`cpu-host-pools` in `cpu/host_pools.py`),
    and the entry has no `module_why` saying why (a family module hosting several)."""
    bad = []
    for e in entries:
        leaf = e["module"].rpartition(".")[2]
        pid = e["id"].replace("-", "_")
        group = e.get("group", "").replace("-", "_")
        named = leaf == pid or (pid.startswith(group + "_") and leaf == pid[len(group) + 1 :])
        if not named and not e.get("module_why", "").strip():
            bad.append(f"{e['id']}: module {e['module']} (name it for the patch, or say why in module_why)")
    return bad


def test_module_is_named_for_the_patch_or_the_entry_says_why() -> None:
    import tomllib

    from sglang_l3.patches.framework import SERIES_PATH

    with open(SERIES_PATH, "rb") as f:
        entries = tomllib.load(f)["patch"]
    assert module_mismatches(entries) == []
    # negative control: the shapes the check must catch and pass
    probe = [
        {"id": "sessions", "group": "sessions", "module": "sglang_l3.patches.sessions.session_api"},
        {"id": "cpu-host-pools", "group": "cpu", "module": "sglang_l3.patches.cpu.host_pools"},
        {"id": "tp-x", "group": "tp", "module": "sglang_l3.patches.tp.agreement", "module_why": "a family"},
    ]
    assert module_mismatches(probe) == [
        "sessions: module sglang_l3.patches.sessions.session_api (name it for the patch, or say why in module_why)"
    ]


def test_the_check_sees_a_violation(tmp_path) -> None:
    """The walker catches both shapes of import (negative control of the check)."""
    p = PKG / "quant" / "_layering_probe.py"
    p.write_text("from sglang_l3.patches import framework\nimport sglang_l3.testing.stack\n")
    q = PKG / "patches" / "_layering_probe.py"
    q.write_text("from sglang_l3.storage.sessions_cli import run\nfrom sglang_l3.sim import streams\n")
    r = PKG / "storage" / "_layering_probe.py"
    r.write_text("from sglang_l3.patches.hicache.streamed_restore import _x\nimport sglang_l3.faults as f\nf._y\n")
    try:
        found = violations()
        reach = underscore_reach_ins(("python",))
    finally:
        p.unlink()
        q.unlink()
        r.unlink()
    assert any("patches/_layering_probe.py:2" in v and "test machinery" in v for v in found)
    assert any("storage/_layering_probe.py:1" in v and "imports _x" in v for v in reach)
    assert any("storage/_layering_probe.py:3" in v and "sglang_l3.faults._y" in v for v in reach)
    assert any("_layering_probe.py:1" in v and "below patches/" in v for v in found)
    assert any("_layering_probe.py:2" in v and "harness" in v for v in found)
    assert any("patches/_layering_probe.py:1" in v and "command-line module" in v for v in found)
