"""A short soak (the full one is benchmark/soak.py): randomized shared-prefix
workload with evictions, aborts and storage faults through the real admission
path; no invariant violation, no leaked slot, restores actually happen."""

from __future__ import annotations

import pytest
from sglang_l3.testing.soak import run_soak


@pytest.mark.slow
def test_short_soak(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_L3_VERIFY", "1")
    rep = run_soak(150, str(tmp_path), seed=3)
    assert rep.violations == [], rep.violations[:3]
    assert rep.leaked == {}
    assert rep.requests >= 150 and rep.restores >= 10, rep.lines()
    assert rep.baseline_checks >= 1
