"""The harness's host pools build on a busy machine (under 10 GiB of RAM free)."""

from __future__ import annotations

from collections import namedtuple

import psutil
import pytest
import torch
from sglang_l3.testing.pools import host_kv_pool, host_mamba_pool

GiB = 1 << 30
_VM = namedtuple("_VM", "available total")


@pytest.fixture
def busy_machine(monkeypatch):
    """psutil reports 4 GiB available: below upstream's fixed 10 GiB host reserve."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _VM(available=4 * GiB, total=24 * GiB))


def _kv():
    return host_kv_pool(layers=2, heads=2, head_dim=8, page_size=4, device_tokens=64)


def test_without_the_budget_scope_upstream_refuses(busy_machine, monkeypatch) -> None:
    """Negative control: the condition is real; without our scope upstream refuses the pool."""
    import contextlib

    from sglang_l3.testing import pools

    monkeypatch.setattr(pools, "host_budget", contextlib.nullcontext)
    with pytest.raises(Exception, match="(?i)host memory"):
        _kv()


def test_pools_build_on_a_busy_machine(busy_machine) -> None:
    kv = _kv()
    assert kv.size > 0
    temporal = torch.zeros(1, dtype=torch.float32).expand(3, 8, 2, 4, 4)
    conv = (torch.zeros(1, dtype=torch.bfloat16).expand(3, 8, 6, 3),)
    mb = host_mamba_pool(temporal, conv)
    assert mb.size > 0
