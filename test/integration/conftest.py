"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from sglang_l3.patches import framework


@pytest.fixture
def without(request):
    """Negative control: run the test with the patch named by the indirect
    parameter removed from this process, then apply it again."""
    pid = request.param
    series = framework.load_series()
    removed = framework.undo(pid)  # with the patches that require it
    yield pid
    for rid in [pid, *removed]:
        framework.apply_one(next(s for s in series if s.id == rid), series)
