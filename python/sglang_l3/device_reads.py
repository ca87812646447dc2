"""Host copies of device index tensors (issue 33 item 2).

On the `direct` io backend upstream's `HiCacheController.move_indices` reads the device
indices to host (`device_indices.cpu()`): on a GPU that is a blocking device->host copy,
a sync of the calling thread. A path that copies many pieces into one set of rows (the
streamed restore's R) takes one host copy when the rows are allocated (`host_copy`) and
hands slices of it to every piece instead.

The copies taken here are remembered weakly (`is_host_copy`, slices included), so the
simulated device (`sglang_l3.sim.streams`) can charge every other such read as the
sync it is on a GPU.
"""

from __future__ import annotations

import weakref

import torch

_COPIES: dict[int, weakref.ref] = {}  # id -> the copy, while it lives


def host_copy(indices: torch.Tensor) -> torch.Tensor:
    """A host copy of `indices` (one device->host read now, none per use later)."""
    t = indices.to("cpu", copy=True)
    key = id(t)
    _COPIES[key] = weakref.ref(t, lambda _r: _COPIES.pop(key, None))
    return t


def is_host_copy(t: torch.Tensor) -> bool:
    """`t` is a copy taken by `host_copy`, or a view of one."""
    root = t._base if t._base is not None else t
    ref = _COPIES.get(id(root))
    return ref is not None and ref() is root
