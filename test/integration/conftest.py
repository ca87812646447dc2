"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from sglang_l3.patches import framework


@pytest.fixture
def without(request):
    """Negative control: run the test with the patch named by the indirect
    parameter removed from this process, then apply it again."""
    pid = request.param
    spec = next(s for s in framework.load_series() if s.id == pid)
    framework.undo(pid)
    yield pid
    framework.apply_one(spec)
