"""Host-pool page <-> payload bytes, without copies.

A payload is exactly the bytes upstream's flat data page holds
(`get_data_page(index, flat=True)`: the row-major bytes of the page's
tensors), so the on-disk bytes do not depend on how we move them. Instead of
materializing that flat tensor, we describe the page as "runs": memoryviews
straight into the pool's buffers (two for a page_first KV page - K and V;
one per state tensor for a Mamba slot). preadv/pwritev then move bytes
between the disk and the pool directly.

A pool whose pages are not views of its memory (an unknown pool type) falls
back to the copy path: the flat page upstream would use, plus
`set_from_flat_data_page` after a verified read.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang_l3.storage.identity import PoolLayout

logger = logging.getLogger(__name__)

Run = tuple[Any, int, int]  # (untyped storage, byte offset, nbytes)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def tensor_runs(t: torch.Tensor) -> list[Run]:
    """Row-major contiguous byte runs of a CPU tensor view (merged when adjacent)."""
    out: list[Run] = []

    def walk(x: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        if x.is_contiguous():
            out.append((x.untyped_storage(), int(x.storage_offset()) * x.element_size(), x.numel() * x.element_size()))
            return
        for i in range(x.shape[0]):
            walk(x[i])

    walk(t)
    merged: list[Run] = []
    for s, off, n in out:
        if merged and merged[-1][0].data_ptr() == s.data_ptr() and merged[-1][1] + merged[-1][2] == off:
            ps, poff, pn = merged[-1]
            merged[-1] = (ps, poff, pn + n)
        else:
            merged.append((s, off, n))
    return merged


class _StorageViews:
    """One writable memoryview per distinct storage, sliced per run."""

    def __init__(self) -> None:
        self._mv: dict[int, tuple[Any, memoryview]] = {}

    def view(self, storage: Any, off: int, n: int) -> memoryview:
        ptr = storage.data_ptr()
        hit = self._mv.get(ptr)
        if hit is None or hit[1].nbytes < storage.nbytes():
            arr = (ctypes.c_ubyte * storage.nbytes()).from_address(ptr)
            hit = (storage, memoryview(arr).cast("B"))  # storage kept alive here
            self._mv[ptr] = hit
        return hit[1][off : off + n]


@dataclass
class Target:
    runs: list[memoryview]
    commit: Callable[[], None] | None = None  # copy path: staging -> pool after a verified read
    keep: Any = None  # keeps a staging tensor alive


class PageMap:
    def __init__(self, pool: Any, name: str):
        self.pool = pool
        self.name = name
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self._views = _StorageViews()
        flat = pool.get_dummy_flat_data_page()
        self.flat_bytes = flat.numel() * flat.element_size()
        self._flat_dtype = flat.dtype
        self._template: list[tuple[Any, int, int, int]] | None = None
        self.zero_copy = False
        comps: list[tuple[str, tuple[int, ...]]] = []
        try:
            views = self._page_views(0)
            if views is not None:
                runs = [r for v in views for r in tensor_runs(v)]
                if sum(n for _, _, n in runs) == self.flat_bytes:
                    self.zero_copy = True
                    comps = [(_dtype_name(v.dtype), tuple(v.shape)) for v in views]
                    self._template = self._build_template(runs)
                else:
                    logger.warning(
                        "sglang-l3 store: pool %s page views hold %d bytes, flat page %d; using the copy path",
                        name,
                        sum(n for _, _, n in runs),
                        self.flat_bytes,
                    )
        except Exception as e:  # unknown pool shape: copy path is always correct
            logger.info("sglang-l3 store: pool %s has no zero-copy page views (%s)", name, e)
        if not self.zero_copy:
            comps = [(_dtype_name(flat.dtype), (flat.numel(),))]
        self.layout = PoolLayout(
            pool=name,
            layout=str(getattr(pool, "layout", "unknown")),
            page_size=self.page_size,
            components=tuple(comps),
            payload_bytes=self.flat_bytes,
        )

    # The pool's own serialization order, as views (None: not views).
    def _page_views(self, index: int) -> list[torch.Tensor] | None:
        pool = self.pool
        if hasattr(pool, "_iter_page_tensors"):  # Mamba: temporal, conv..., side states
            return list(pool._iter_page_tensors(index))
        a = pool.get_data_page(index, flat=False)
        b = pool.get_data_page(index, flat=False)
        if a.data_ptr() != b.data_ptr() or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return None  # a fresh copy each call, not a view
        return [a]

    def _n_pages(self) -> int:
        size = getattr(self.pool, "size", None)
        return int(size) // self.page_size if size else 0

    def _build_template(self, runs0: list[Run]) -> list[tuple[Any, int, int, int]] | None:
        """Runs of page p = runs of page 0 shifted by p * delta (checked on two more pages)."""
        n = self._n_pages()
        if n < 2:
            return None
        views1 = self._page_views(self.page_size)
        runs1 = [r for v in views1 or [] for r in tensor_runs(v)]
        if len(runs1) != len(runs0):
            return None
        tmpl = []
        for (s0, o0, n0), (s1, o1, n1) in zip(runs0, runs1, strict=True):
            if s0.data_ptr() != s1.data_ptr() or n0 != n1:
                return None
            tmpl.append((s0, o0, o1 - o0, n0))
        last = (n - 1) * self.page_size
        runs_last = [r for v in self._page_views(last) or [] for r in tensor_runs(v)]
        predicted = [(s.data_ptr(), o + (n - 1) * d, k) for s, o, d, k in tmpl]
        if [(s.data_ptr(), o, k) for s, o, k in runs_last] != predicted:
            return None
        return tmpl

    def _runs(self, index: int) -> list[memoryview]:
        if self._template is not None and index % self.page_size == 0:
            p = index // self.page_size
            return [self._views.view(s, o + p * d, k) for s, o, d, k in self._template]
        views = self._page_views(index) or []
        return [self._views.view(s, o, k) for v in views for s, o, k in tensor_runs(v)]

    # ------------------------------------------------------------------ API
    def source(self, index: int) -> Target:
        """Bytes to write for the page starting at host index `index`."""
        if self.zero_copy:
            return Target(self._runs(index))
        data = self.pool.get_data_page(index, flat=True).contiguous()
        return Target(flat_tensor_target(data), keep=data)

    def target(self, index: int) -> Target:
        """Where to read the page starting at host index `index`."""
        if self.zero_copy:
            return Target(self._runs(index))
        staging = self.pool.get_dummy_flat_data_page()
        return Target(
            flat_tensor_target(staging), commit=lambda: self.pool.set_from_flat_data_page(index, staging), keep=staging
        )


def flat_tensor_target(t: torch.Tensor) -> list[memoryview]:
    """One run over a contiguous tensor (copy path, legacy get/set API); the
    caller keeps `t` alive while the run is in use."""
    if not t.is_contiguous():
        raise ValueError("flat page tensor must be contiguous")
    s = t.untyped_storage()
    arr = (ctypes.c_ubyte * s.nbytes()).from_address(s.data_ptr())
    off = t.storage_offset() * t.element_size()
    return [memoryview(arr).cast("B")[off : off + t.numel() * t.element_size()]]
