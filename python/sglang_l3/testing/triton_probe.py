"""Can this Triton interpreter run our kernels? Asked by the `--dry-run` of
test/gpu/gptq_check.py and benchmark/gptq_bench.py before any case runs.

Triton 3.6's interpreter (the GPU image's Triton) hands a kernel its program ids as
1-element arrays; a loop bounded by them (`range(k_lo, k_hi, step)`, as the split-K
kernels have) converts them with `int()`, which NumPy 2.4 refuses ("only
0-dimensional arrays can be converted to Python scalars"; NumPy 2.3 only warned;
Triton 3.8's interpreter passes scalars). Found on 2026-12-07 with Python 3.12.1,
torch 2.11.0, Triton 3.6.0 and NumPy 2.4.6 / 2.5.5: every case failed with that
traceback, the kernels untouched. Only the interpreter is concerned: on a GPU the
kernels are compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bounded_loop(out_ptr, step, n):
    pid = tl.program_id(0)
    lo = pid * n
    acc = 0
    for _ in range(lo, lo + n, step):
        acc += 1
    tl.store(out_ptr + pid, acc)


def interpreter_problem() -> str | None:
    """None when a loop bounded by program ids runs here; else what to change."""
    out = torch.zeros(2, dtype=torch.int32)
    try:
        _bounded_loop[(2,)](out, 2, 4)
    except Exception as e:  # noqa: BLE001 - reported, with the versions, instead of a traceback per case
        import numpy

        why = (
            f"the Triton {triton.__version__} interpreter cannot run a loop bounded by program ids with "
            f"NumPy {numpy.__version__} ({type(e).__name__}: {e})"
        )
        if "0-dimensional" not in str(e):
            return why  # another cause: no fix is guessed
        return why + "; for a dry run use NumPy < 2.4 (e.g. pip install 'numpy<2.4') or Triton >= 3.8"
    if out.tolist() != [2, 2]:
        return f"the Triton {triton.__version__} interpreter ran a bounded loop {out.tolist()} times, not [2, 2]"
    return None
