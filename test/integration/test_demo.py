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
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
