"""TEST-ONLY stand-in for the `sgl_kernel` package, carried only in the GPU test
kit (`test/gpu/build_kit.py` copies it into the kit's site/). Never installed
in a venv, never imported by sglang_l3's runtime code.

The lent GPU machine has no sgl-kernel wheel, yet ~300 SGLang 0.5.23 modules
import it at module level under `is_cuda()` (`from sgl_kernel import x`,
`import sgl_kernel.x`). With `--hicache-io-backend direct` and
`--hicache-mem-layout page_first_direct` the host pools (`pool_host/mha.py`,
`mamba.py`, `mla.py`, `dsa.py`) only call three ops, bound in `kvcacheio` from
`sglang_l3.cpu.transfer_ops` (torch narrow/copy_, fine on CUDA tensors).

Everything else (any attribute of this package or of any `sgl_kernel.*`
submodule, served by a meta-path finder) imports fine and raises
NotImplementedError naming itself when CALLED. Consequences, chosen on purpose:

- `try: from sgl_kernel import x / except ImportError: <fallback>` gets the stub,
  not the fallback: raising ImportError instead would break the ~300
  unconditional module-level imports, which is what the kit must load. A test
  that reaches such a kernel fails loudly with the message below rather than
  silently running a fallback the production box never runs.
  Two exceptions, in `ABSENT`, raise ImportError so upstream's fallback runs
  as it does without sgl-kernel: `scalar_type` (quantization/utils.py builds
  module-level constants from it; stubs there would be silently wrong values,
  the fallback is what the CPU suite tests) and `allreduce` (custom
  all-reduce off, NCCL instead, rather than a TP run failing in the stub).
- `hasattr(sgl_kernel, "x")` (and on any submodule) is always True, except
  for the `ABSENT` names; dunder names are real lookups, so introspection,
  pickling and mocks behave.
- `torch.ops.sgl_kernel` stays empty (no ops are registered), so probes such
  as `hasattr(torch.ops.sgl_kernel, "get_device_accessible_ptr")` see False
  and take their documented fallbacks.

`__version__` and the kit's `sglang_kernel-<ver>.dist-info` (written by the
builder from this value) satisfy 0.5.23's `assert_pkg_version("sglang-kernel",
"0.4.9", ...)` (sglang 0.5.23 pins sglang-kernel==0.4.10).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.4.10"

# Submodules that raise ImportError (see the docstring), with why.
ABSENT = {
    "scalar_type": "upstream falls back to its mock scalar types, as in the CPU suite",
    "allreduce": "upstream turns custom all-reduce off and uses NCCL",
}

_WHY = (
    "not in sglang-l3's GPU test kit shim (test/gpu/kit/sgl_kernel); only the direct KV "
    "transfer ops are bound. The ROCm/CUDA production box uses sgl-kernel's own kernels."
)


class _Missing:
    """A name the shim does not implement: importable, attribute-chainable
    (`from sgl_kernel import common_ops; common_ops.x`), fails when called."""

    __slots__ = ("_qualname",)

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{self._qualname}: {_WHY}")

    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel shim stub {self._qualname}>"


def missing_getattr(module_name: str) -> Any:
    """A PEP 562 module `__getattr__` that hands out stubs for `module_name`."""

    def __getattr__(name: str) -> _Missing:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return _Missing(f"{module_name}.{name}")

    return __getattr__


_stub_getattr = missing_getattr(__name__)


def __getattr__(name: str) -> _Missing:
    if name in ABSENT:  # so `from sgl_kernel import <name>` imports the submodule, and fails
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _stub_getattr(name)


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # default module creation

    def exec_module(self, module: types.ModuleType) -> None:
        short = module.__name__.split(".")[1]
        if short in ABSENT:
            raise ImportError(
                f"{module.__name__}: left out of sglang-l3's GPU test kit shim on purpose ({ABSENT[short]})",
                name=module.__name__,
            )
        module.__dict__["__getattr__"] = missing_getattr(module.__name__)
        module.__doc__ = f"sglang-l3 GPU test kit stub of {module.__name__}: every attribute raises when called."


class _StubFinder(importlib.abc.MetaPathFinder):
    """Serves any `sgl_kernel.*` submodule without a file here (appended to
    sys.meta_path, so real files such as kvcacheio.py win). Stubs are packages,
    so `import sgl_kernel.a.b` works too."""

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubFinder())
