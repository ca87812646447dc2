"""`make demo`'s engine: agents through L3 on disk, all restores bit-exact."""

from __future__ import annotations

import stat

from sglang_l3.testing import demo


def test_demo_restores_every_agent_bit_exact(tmp_path, capsys) -> None:
    store = tmp_path / "l3-store"
    rc = demo.run(str(store), n_agents=3, page=16, system_tokens=64)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "6/6 restores bit-exact" in out
    assert "MISMATCH" not in out
    # small restores: ms per restore and what it means, no GB/s figure
    assert "fixed latency: p50" in out and "What the numbers mean" in out
    assert "GB/s is shown only from" in out
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
