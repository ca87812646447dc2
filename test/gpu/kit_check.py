"""Check the GPU test kit (test/gpu/build_kit.py) under the TARGET Python: the
kit's site/ first on PYTHONPATH, then the repo's python/.

  # record the modules a pytest selection imports (conftest + test modules)
  python test/gpu/kit_check.py --record closure.txt [--paths test/integration test/unit]
  # import each recorded module; --force-cuda makes SGLang take its CUDA branches
  python test/gpu/kit_check.py --closure closure.txt [--force-cuda]
  # every sglang module that imports sgl_kernel (then --closure it with --force-cuda)
  python test/gpu/kit_check.py --list-importers importers.txt

Prints `kit_check: imported N/M modules`; exit 0 when all import, 1 otherwise
(each failure listed as `module: ExcType: first line`), 2 on bad usage.
Run from the repository root (pytest reads its rootdir and conftest there).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
import time
import traceback
import types
from pathlib import Path

PREFIXES = ("sglang", "sgl_kernel")  # "sglang" also covers sglang_l3
FORCED_CUDA_VERSION = "13.0"
FORCED_DEVICE_NAME = "kit_check --force-cuda (no device)"
FORCED_CAPABILITY = (9, 0)


def force_cuda() -> list[str]:
    """Make `sglang.srt.utils.common.is_cuda()` true on a machine without a GPU.

    0.5.23 decides it as `torch.cuda.is_available() and torch.version.cuda is
    not None` (and `is_hip()` as `torch.version.hip is not None`), evaluated
    at module level in ~300 modules, so this must run before any sglang import.
    Those two inputs are forced, plus the device queries SGLang makes at import
    (`sglang.srt.platforms` asks `get_device_name()` to rule out SAIL; others
    ask the capability), answered as one sm90 device, since without a driver
    they raise. Nothing else: allocations and kernels still fail, so a module
    that touches the device at import is reported. On a machine with a CUDA GPU
    nothing is changed."""
    import torch

    if "sglang" in sys.modules:
        raise RuntimeError("--force-cuda must run before sglang is imported")
    forced = []
    if torch.version.hip is not None:
        raise RuntimeError("--force-cuda on a ROCm torch build: is_hip() would win, refusing")
    if torch.version.cuda is None:
        torch.version.cuda = FORCED_CUDA_VERSION
        forced.append(f"torch.version.cuda = {FORCED_CUDA_VERSION!r} (was None: CPU torch build)")
    if torch.cuda.is_available():
        return forced
    props = types.SimpleNamespace(
        name=FORCED_DEVICE_NAME,
        major=FORCED_CAPABILITY[0],
        minor=FORCED_CAPABILITY[1],
        total_memory=80 << 30,
        multi_processor_count=132,
        warp_size=32,
        gcnArchName="",
    )
    fakes = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_name": lambda device=None: FORCED_DEVICE_NAME,
        "get_device_capability": lambda device=None: FORCED_CAPABILITY,
        "get_device_properties": lambda device=None: props,
    }
    for name, fn in fakes.items():
        setattr(torch.cuda, name, fn)
    forced.append(
        f"torch.cuda.{{{','.join(fakes)}}} answer one {FORCED_DEVICE_NAME!r}, sm"
        f"{FORCED_CAPABILITY[0]}{FORCED_CAPABILITY[1]} (no usable CUDA device here)"
    )
    return forced


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def record(out: Path, paths: list[str]) -> int:
    """Collect `paths` with pytest in this process, then write the sorted
    sglang*/sgl_kernel* names in sys.modules to `out`."""
    import pytest

    rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *paths])
    names = sorted(n for n in sys.modules if n.split(".")[0].startswith(PREFIXES))
    out.write_text("".join(f"{n}\n" for n in names))
    print(f"kit_check: recorded {len(names)} modules to {out} (pytest --collect-only rc={int(rc)})")
    return 0 if rc == 0 else 1


def report_sgl_kernel() -> None:
    """Which sgl_kernel was loaded and how many sglang modules hold names from it:
    evidence that the CUDA import branches ran through the kit's shim."""
    sk = sys.modules.get("sgl_kernel")
    if sk is None:
        print("kit_check: sgl_kernel not imported (no CUDA branch taken)")
        return
    subs = sorted(n.split(".", 1)[1] for n in sys.modules if n.startswith("sgl_kernel."))
    bound = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("sglang") or mod is None:
            continue
        for v in list(vars(mod).values()):
            owner = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
            if type(v).__module__ == "sgl_kernel" or (isinstance(owner, str) and owner.startswith("sgl_kernel")):
                bound.add(name)
                break
    print(f"kit_check: sgl_kernel {getattr(sk, '__version__', '?')} from {getattr(sk, '__file__', '?')}")
    print(f"kit_check: {len(bound)} sglang modules hold sgl_kernel names; submodules loaded: {', '.join(subs)}")
    ops = sys.modules.get("sglang_l3.cpu.transfer_ops")
    for name in getattr(ops, "HOST_POOL_MODULES", ()):
        mod = sys.modules.get(name)
        if mod is not None:
            got = [op for op, fn in ops.OPS.items() if getattr(mod, op, None) is fn]
            print(f"kit_check: {name} binds {len(got)}/{len(ops.OPS)} direct ops from sglang_l3.cpu.transfer_ops")


_IMPORTS_SGL_KERNEL = re.compile(r"^\s*(from sgl_kernel(\.[\w.]+)? import|import sgl_kernel)", re.M)


def list_importers(out: Path) -> int:
    """Write every sglang module whose source imports sgl_kernel (at any depth),
    read from the files without importing sglang: a closure for --force-cuda."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        print("kit_check: sglang not found on sys.path")
        return 1
    root = Path(next(iter(spec.submodule_search_locations)))
    names = []
    for f in sorted(root.rglob("*.py")):
        if _IMPORTS_SGL_KERNEL.search(f.read_text(errors="replace")):
            parts = f.relative_to(root.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    out.write_text("".join(f"{n}\n" for n in names))
    print(f"kit_check: {len(names)} sglang modules under {root} import sgl_kernel; listed in {out}")
    return 0


def import_closure(closure: Path, verbose: bool) -> int:
    names = [n.strip() for n in closure.read_text().splitlines() if n.strip() and not n.startswith("#")]
    failures: list[tuple[str, str]] = []
    t0 = time.monotonic()
    for name in names:
        try:
            importlib.import_module(name)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit from a module counts as a failure too
            failures.append((name, _first_line(e)))
            if verbose:
                traceback.print_exc()
    ok = len(names) - len(failures)
    print(f"kit_check: imported {ok}/{len(names)} modules ({time.monotonic() - t0:.1f}s)")
    report_sgl_kernel()
    for name, why in failures:
        print(f"  FAIL {name}: {why}")
    return 0 if not failures else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--closure", type=Path, help="import every module named in FILE (one per line)")
    mode.add_argument("--record", type=Path, help="write the modules a pytest collection imports to FILE")
    mode.add_argument("--list-importers", type=Path, help="write the sglang modules that import sgl_kernel to FILE")
    ap.add_argument(
        "--paths", nargs="+", default=["test/integration", "test/unit"], help="pytest selection for --record"
    )
    ap.add_argument("--force-cuda", action="store_true", help="make SGLang's is_cuda() true before importing")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each failure's traceback")
    args = ap.parse_args(argv)

    print(f"kit_check: python {sys.version.split()[0]} at {sys.executable}")
    if args.force_cuda:
        forced = force_cuda()
        print("kit_check: --force-cuda forced: " + ("; ".join(forced) if forced else "nothing (CUDA already present)"))
    import torch

    print(f"kit_check: torch {torch.__version__} (cuda {torch.version.cuda}, available {torch.cuda.is_available()})")
    if args.record:
        return record(args.record, args.paths)
    if args.list_importers:
        return list_importers(args.list_importers)
    return import_closure(args.closure, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
