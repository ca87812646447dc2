"""Build the GPU test kit: what the lent GPU machine (Python 3.12, torch
2.11+cu130, Triton, numpy, pytest; no sglang, no sgl-kernel, no package index)
needs to import the project's CPU suite, carried as one xz tarball.

  .venv/bin/python test/gpu/build_kit.py                 # -> .gpukit/{site.tar.xz,manifest.json}
  .venv/bin/python test/gpu/build_kit.py --check-only    # verify the kit against its manifest
  # on the GPU machine (carry .gpukit/site.tar.xz and .gpukit/manifest.json, not .gpukit/wheels):
  tar -xJf .gpukit/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD/python
  # (+ :/tmp/runner where the image's pytest has no pytest-xdist)

The kit's site/ holds SGLang (the pin in sglang_l3.SGLANG_PIN, .py tree and
package data, of its Rust extensions only the tree core), the wheels below at
the versions installed in this repo's .venv (the ones the CPU suite runs
against), and the test-only sgl_kernel shim (test/gpu/kit/sgl_kernel); its runner/
holds pytest-xdist and execnet, for an image whose pytest lacks them. Wheels
are fetched with pip for the target's tags, cached in <out>/wheels (reruns are
offline), unpacked without pip so nothing is byte-compiled for the wrong Python.
Exit: 0 ok; 1 failure, with a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[2]
VENV_PIP = REPO / ".venv" / "bin" / "pip"
SHIM = REPO / "test" / "gpu" / "kit" / "sgl_kernel"
DEFAULT_OUT = REPO / ".gpukit"
TARBALL, MANIFEST = "site.tar.xz", "manifest.json"

MiB = 1 << 20
# The device tool carries at most 64 MiB per call (working tree + carried paths).
CARRY_LIMIT = 64 * MiB
# Kept free for what else a call may carry (build outputs, results, repo growth).
HEADROOM = 8 * MiB

# The lent image's glibc is 2.39; pip matches manylinux_2_N exactly, so list them all.
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(5, 40)
]

# Missing on the image and imported (directly or by the packages below) by the
# modules the CPU suite loads; found by an earlier survey of the image.
SURVEYED_MISSING = [
    "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "orjson", "pybase64", "msgspec",
    "pyzmq", "starlette", "fastapi", "uvicorn", "ipython", "traitlets", "openai", "distro", "sniffio",
    "partial-json-parser", "xgrammar", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
    "apache-tvm-ffi", "compressed-tensors", "loguru", "gguf", "dill", "opentelemetry-api", "setproctitle",
]  # fmt: skip
# Also imported at module level by that closure (sglang's own requirements are
# not followed: they are mostly GPU kernels the image has or the suite avoids).
IMPORTED_TOO = [
    "transformers", "huggingface-hub", "tokenizers", "safetensors", "regex", "aiohttp", "requests",
    "einops", "psutil", "pillow", "python-multipart", "uvloop", "xxhash", "pyyaml", "torchvision",
    "sentencepiece",
    # on the image only if pytest is; pydantic needs typing-extensions>=4.16
    "packaging", "pygments", "typing-extensions",
]  # fmt: skip
# Built against one torch release: take the one that pairs with the image's
# torch 2.11, not the venv's (which pairs with the venv's torch).
TORCH_BOUND = {"torchvision": "0.26.0"}
# Installed with torch 2.11 (or are torch/Triton/CUDA themselves): never carried,
# never shadowed.
IMAGE_HAS = re.compile(
    r"^(torch|triton|numpy|nvidia-.*|cuda-.*|filelock|fsspec|jinja2|markupsafe|mpmath|networkx|sympy|setuptools)$"
)
# The test runner's parallel plugin, carried beside site/ in runner/ (not resolved:
# pytest itself is the image's). cache_check.sh puts runner/ on the path only where
# the image's Python cannot import xdist, so an image's own copy is never shadowed;
# without it the selection would run in one process, too slow for the budget.
RUNNER = ["pytest-xdist", "execnet"]
# Dependencies left out: big, and not needed to import any module the suite loads.
LEFT_OUT = {
    "hf-xet": "huggingface-hub's Xet download backend (a ~9 MB .so); imported only when downloading",
    "jedi": "IPython imports it lazily, for completion only; 33 MB unpacked (typeshed stubs)",
}
# Pruned from the unpacked tree (glob relative to site/, reason). dist-info/RECORD
# stays: tvm_ffi finds xgrammar's library through it.
PRUNE = [
    ("**/__pycache__", "bytecode of the builder's Python"),
    ("sglang/srt/rust_extensions/*.so", "server/grpc/bench/multimodal Rust extensions: unused by the suite"),
]
PRUNE_TESTS_EXCEPT = ("sglang",)  # third-party tests/ folders are never imported at run time


class KitError(Exception):
    pass


def target_env(py: str) -> dict[str, str]:
    return {
        "python_version": py,
        "python_full_version": f"{py}.3",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def target_tags(py: str) -> set[Tag]:
    major, minor = (int(x) for x in py.split("."))
    abi = f"cp{major}{minor}"
    return set(cpython_tags((major, minor), [abi], PLATFORMS)) | set(
        compatible_tags((major, minor), f"cp{major}{minor}", PLATFORMS)
    )


def venv_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def resolve(py: str) -> tuple[dict[str, dict], list[dict]]:
    """Roots plus their run-time dependencies (this venv's metadata, markers for
    the target), less what the image has and LEFT_OUT. Returns {canonical
    name: {name, version, why}} and the left-out records."""
    env = target_env(py)
    todo = [(n, "surveyed missing on the image") for n in SURVEYED_MISSING]
    todo += [(n, "imported by the suite's closure") for n in IMPORTED_TOO]
    want: dict[str, dict] = {}
    left: dict[str, dict] = {}
    while todo:
        name, why = todo.pop(0)
        key = canonicalize_name(name)
        if key in want or key in left or IMAGE_HAS.match(key):
            continue
        if key in LEFT_OUT:
            left[key] = {"name": key, "needed_by": why, "why": LEFT_OUT[key]}
            continue
        version = venv_version(name)
        want[key] = {"name": key, "venv_version": version, "why": why}
        if version is None:
            continue
        for req in md.requires(name) or []:
            r = Requirement(req)
            if r.marker is None or Marker(str(r.marker)).evaluate(env):
                todo.append((r.name, f"dependency of {key}"))
    return want, list(left.values())


def pip_download(specs: list[str], wheels: Path, py: str) -> subprocess.CompletedProcess[str]:
    major, minor = py.split(".")
    cmd = [str(VENV_PIP), "download", "--no-deps", "--only-binary=:all:", "--python-version", py]
    cmd += ["--implementation", "cp", "--abi", f"cp{major}{minor}", "-d", str(wheels), "--progress-bar", "off"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return subprocess.run([*cmd, *specs], capture_output=True, text=True)


def pip_versions(name: str, py: str) -> list[Version]:
    """Versions with a wheel for the target, from `pip index versions`."""
    major, minor = py.split(".")
    cmd = [str(VENV_PIP), "index", "versions", name, "--only-binary=:all:", "--python-version", py]
    cmd += ["--implementation", "cp", "--abi", f"cp{major}{minor}"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    m = re.search(r"Available versions: (.*)", out)
    vs = []
    for v in m.group(1).split(", ") if m else []:
        with contextlib.suppress(InvalidVersion):
            vs.append(Version(v))
    return vs


def nearest(want: str, have: list[Version]) -> Version | None:
    """The closest release: same-or-lower first (what the venv's code expects
    at most), else the lowest higher one."""
    w = Version(want)
    lower = [v for v in have if v <= w and not v.is_prerelease]
    higher = [v for v in have if v > w and not v.is_prerelease]
    return max(lower) if lower else (min(higher) if higher else None)


def cached_wheel(wheels: Path, name: str, version: str, tags: set[Tag]) -> Path | None:
    for f in sorted(wheels.glob("*.whl")):
        n, v, _, wtags = parse_wheel_filename(f.name)
        if n == canonicalize_name(name) and v == Version(version) and wtags & tags:
            return f
    return None


def fetch(pkgs: dict[str, dict], wheels: Path, py: str) -> None:
    """Fill each package's `wheel` (and `version`) from the cache or pip."""
    tags = target_tags(py)
    wheels.mkdir(parents=True, exist_ok=True)
    missing = []
    for p in pkgs.values():
        p["version"] = p["venv_version"]
        if p["name"] in TORCH_BOUND:
            p["version"] = TORCH_BOUND[p["name"]]
            p["note"] = f"pairs with the image's torch 2.11 (venv: {p['venv_version']}, for its torch)"
        if p["version"] is None or not cached_wheel(wheels, p["name"], p["version"], tags):
            missing.append(p)
    if missing:
        specs = [f"{p['name']}=={p['version']}" if p["version"] else p["name"] for p in missing]
        print(f"build_kit: downloading {len(specs)} wheels", file=sys.stderr)
        if pip_download(specs, wheels, py).returncode != 0:
            for p, spec in zip(missing, specs, strict=True):  # find the ones without a target wheel
                if pip_download([spec], wheels, py).returncode == 0:
                    continue
                if p["version"] is None:
                    raise KitError(f"no {py} manylinux wheel of {p['name']} at all")
                alt = nearest(p["version"], pip_versions(p["name"], py))
                if alt is None or pip_download([f"{p['name']}=={alt}"], wheels, py).returncode != 0:
                    raise KitError(f"no {py} manylinux wheel of {p['name']} (venv has {p['version']})")
                p["version"] = str(alt)
                p["note"] = f"no cp{py.replace('.', '')} manylinux wheel of {p['venv_version']}: nearest taken"
    for p in pkgs.values():
        if p["version"] is None:  # pip chose; read it back from what it saved
            for f in sorted(wheels.glob("*.whl")):
                n, v, _, wtags = parse_wheel_filename(f.name)
                if n == p["name"] and wtags & tags:
                    p["version"], p["note"] = str(v), "not installed in the venv: pip's newest"
        f = cached_wheel(wheels, p["name"], p["version"], tags)
        if f is None:
            raise KitError(f"{p['name']}=={p['version']}: pip reported success but no matching wheel in {wheels}")
        p["wheel"] = f.name


def unpack(wheel: Path, site: Path) -> None:
    """Install a wheel by unzipping it: .data/purelib|platlib go to the root,
    other .data parts (scripts, headers, data) are dropped."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            dest = site.joinpath(*parts)
            if info.is_dir():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                dest.chmod(mode | 0o600)


def tree_size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def prune(site: Path) -> list[dict]:
    done = []
    for pattern, why in PRUNE:
        paths = sorted(site.glob(pattern))
        if paths:
            rec = {"pattern": pattern, "why": why, "count": len(paths), "bytes": sum(map(tree_size, paths))}
            if len(paths) <= 20:
                rec["paths"] = [str(p.relative_to(site)) for p in paths]
            done.append(rec)
            for p in paths:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    tests = [
        p
        for p in sorted(site.glob("*/**/tests"))
        if p.is_dir() and p.relative_to(site).parts[0] not in PRUNE_TESTS_EXCEPT
    ]
    tests = [t for t in tests if not any(o in t.parents for o in tests)]
    if tests:
        done.append(
            {
                "pattern": "<package>/**/tests (not sglang)",
                "why": "third-party test suites, never imported at run time",
                "count": len(tests),
                "bytes": sum(map(tree_size, tests)),
                "paths": [str(t.relative_to(site)) for t in tests],
            }
        )
        for t in tests:
            shutil.rmtree(t)
    return done


def shim_version() -> str:
    m = re.search(r'^__version__ = "([^"]+)"', (SHIM / "__init__.py").read_text(), re.M)
    if not m:
        raise KitError(f"no __version__ in {SHIM / '__init__.py'}")
    return m.group(1)


def add_shim(site: Path) -> str:
    """Copy the sgl_kernel shim and give it the `sglang-kernel` metadata that
    sglang's assert_pkg_version("sglang-kernel", ...) reads."""
    if (site / "sgl_kernel").exists():
        raise KitError("a real sgl_kernel got into the kit; the shim must be the only one")
    shutil.copytree(SHIM, site / "sgl_kernel", ignore=shutil.ignore_patterns("__pycache__"))
    ver = shim_version()
    info = site / f"sglang_kernel-{ver}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: sglang-kernel\nVersion: {ver}\n"
        "Summary: sglang-l3 GPU test kit shim (test/gpu/kit/sgl_kernel), not the real sgl-kernel\n"
    )
    (info / "top_level.txt").write_text("sgl_kernel\n")
    (info / "INSTALLER").write_text("sglang-l3 build_kit\n")
    return ver


def add_project_metadata(site: Path) -> str:
    """A dist-info for sglang-l3 itself (its code stays in the repo's python/,
    on PYTHONPATH): SGLang processes find the `l3` plugin through the
    `sglang.srt.plugins` entry point, so without it test servers' children
    would run unpatched."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name, ver = project["name"], project["version"]
    info = site / f"{name.replace('-', '_')}-{ver}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n"
        "Summary: entry points only; the code is the repository's python/ on PYTHONPATH\n"
    )
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text(
        "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
    )
    (info / "INSTALLER").write_text("sglang-l3 build_kit\n")
    return f"{name}=={ver}: " + ", ".join(f"{g}:{k}" for g, eps in groups.items() for k in eps)


def make_tarball(trees: dict[str, Path], out: Path) -> None:
    """Each tree under its name (site/, runner/). Reproducible: sorted names, zeroed
    owners and times."""

    def norm(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        ti.mtime = 0
        return ti

    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for name, root in sorted(trees.items()):
            tar.add(root, arcname=name, recursive=False, filter=norm)
            for p in sorted(root.rglob("*")):
                tar.add(p, arcname=str(Path(name) / p.relative_to(root)), recursive=False, filter=norm)
    tmp.replace(out)


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def repo_bytes() -> int | None:
    """What a device call carries of the working tree: tracked files plus
    untracked, not-ignored ones. None where git cannot tell (the device
    machine's copy of the tree need not be a repository)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for rel in {r for r in out.decode().split("\0") if r}:
        p = REPO / rel
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def check_budget(kit_bytes: int) -> dict:
    counted = repo_bytes()
    repo = 0 if counted is None else counted
    budget = CARRY_LIMIT - HEADROOM
    info = {
        "kit_bytes": kit_bytes,
        "repo_bytes": repo,
        "total_bytes": kit_bytes + repo,
        "limit_bytes": CARRY_LIMIT,
        "headroom_bytes": HEADROOM,
        "repo_counted": counted is not None,
    }
    if kit_bytes + repo > budget:
        raise KitError(
            f"kit {kit_bytes / MiB:.1f} MiB + repo {repo / MiB:.1f} MiB = {(kit_bytes + repo) / MiB:.1f} MiB "
            f"exceeds the {CARRY_LIMIT // MiB} MiB carry limit less {HEADROOM // MiB} MiB headroom"
        )
    return info


def sglang_pin() -> str:
    text = (REPO / "python" / "sglang_l3" / "__init__.py").read_text()
    m = re.search(r'^SGLANG_PIN = "([^"]+)"', text, re.M)
    if not m:
        raise KitError("no SGLANG_PIN in python/sglang_l3/__init__.py")
    return m.group(1)


def _shown(p: Path) -> str:
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def build(out: Path, py: str) -> dict:
    t0 = time.monotonic()
    pin = sglang_pin()
    if venv_version("sglang") != pin:
        raise KitError(f"the venv has sglang {venv_version('sglang')}, the pin is {pin}")
    pkgs, left = resolve(py)
    pkgs = {"sglang": {"name": "sglang", "venv_version": pin, "why": "the pin (sglang_l3.SGLANG_PIN)"}, **pkgs}
    fetch(pkgs, out / "wheels", py)
    why = "cache_check.sh's -n, used only where the image's Python lacks it"
    runner = {canonicalize_name(n): {"name": canonicalize_name(n), "venv_version": venv_version(n), "why": why}
              for n in RUNNER}  # fmt: skip
    fetch(runner, out / "wheels", py)
    with tempfile.TemporaryDirectory(prefix="gpukit-") as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        for p in pkgs.values():
            unpack(out / "wheels" / p["wheel"], site)
        pruned = prune(site)
        shim_ver = add_shim(site)
        project_eps = add_project_metadata(site)
        runner_dir = Path(tmp) / "runner"
        runner_dir.mkdir()
        for p in runner.values():
            unpack(out / "wheels" / p["wheel"], runner_dir)
        unpacked = tree_size(site)
        print(f"build_kit: site/ is {unpacked / MiB:.1f} MiB unpacked; compressing", file=sys.stderr)
        make_tarball({"site": site, "runner": runner_dir}, out / TARBALL)
    size = (out / TARBALL).stat().st_size
    manifest = {
        "sglang_pin": pin,
        "python": py,
        "python_tag": f"cp{py.replace('.', '')}",
        "platforms": PLATFORMS,
        "packages": sorted(pkgs.values(), key=lambda p: p["name"]),
        "runner": sorted(runner.values(), key=lambda p: p["name"]),
        "left_out": left,
        "image_has": IMAGE_HAS.pattern,
        "pruned": pruned,
        "shim": {"path": str(SHIM.relative_to(REPO)), "sglang_kernel_version": shim_ver},
        "project_entry_points": project_eps,
        "site_unpacked_bytes": unpacked,
        "tarball": {"file": TARBALL, "bytes": size, "sha256": sha256(out / TARBALL)},
        "budget": check_budget(size),
        "command": [_shown(Path(sys.executable)), *sys.argv],
        "build_seconds": round(time.monotonic() - t0, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_only(out: Path) -> dict:
    mf = out / MANIFEST
    if not mf.is_file():
        raise KitError(f"no {mf}: build the kit first")
    manifest = json.loads(mf.read_text())
    tb = out / manifest["tarball"]["file"]
    if not tb.is_file():
        raise KitError(f"no {tb}")
    size, digest = tb.stat().st_size, sha256(tb)
    if size != manifest["tarball"]["bytes"] or digest != manifest["tarball"]["sha256"]:
        raise KitError(f"{tb} is {size} bytes sha256 {digest[:12]}, the manifest says otherwise: rebuild")
    if manifest["sglang_pin"] != sglang_pin():
        raise KitError(f"kit is for sglang {manifest['sglang_pin']}, the repo pins {sglang_pin()}: rebuild")
    if "runner" not in manifest:
        raise KitError("the kit predates runner/ (pytest-xdist for the selection's -n): rebuild")
    if manifest["shim"]["sglang_kernel_version"] != shim_version():
        raise KitError("the sgl_kernel shim's __version__ changed since the kit was built: rebuild")
    manifest["budget"] = check_budget(size)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"kit folder (default {DEFAULT_OUT})")
    ap.add_argument("--check-only", action="store_true", help="verify an existing kit against its manifest")
    ap.add_argument("--python-version", default="3.12", help="target Python X.Y (default 3.12)")
    args = ap.parse_args(argv)
    try:
        if not re.fullmatch(r"3\.\d+", args.python_version):
            raise KitError(f"--python-version {args.python_version!r}: want X.Y")
        out = args.out.resolve()
        if args.check_only:
            m = check_only(out)
        else:
            out.mkdir(parents=True, exist_ok=True)
            m = build(out, args.python_version)
    except KitError as e:
        print(f"build_kit: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # one line, as promised; the traceback helps nobody on a device log
        print(f"build_kit: unexpected {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    b = m["budget"]
    print(
        f"build_kit: {'ok' if args.check_only else 'built'} {out / TARBALL}: {b['kit_bytes'] / MiB:.1f} MiB "
        f"(sha256 {m['tarball']['sha256'][:12]}), {len(m['packages'])} packages; kit + repo "
        f"{b['total_bytes'] / MiB:.1f} MiB of {CARRY_LIMIT // MiB} MiB ({HEADROOM // MiB} MiB kept free)"
        + ("" if b.get("repo_counted", True) else "; the repository not counted (no git here)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
