"""`sglang-l3 doctor` reports real state and fails when something is wrong."""

from __future__ import annotations

import json
import os

from sglang_l3 import SGLANG_PIN, cli, doctor


def _run(capsys, *args: str) -> tuple[int, dict]:
    rc = cli.main(["doctor", "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


def test_doctor_json_lists_every_patch(capsys, tmp_path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    rc, rep = _run(capsys, "--store-dir", str(store))
    checks = {c["name"]: c for c in rep["checks"]}
    assert checks["versions"]["data"]["sglang"] == SGLANG_PIN
    assert checks["platform"]["data"]["kind"] == "cpu"
    assert checks["plugin"]["ok"], "the sglang.srt.plugins entry point must be installed"
    from sglang_l3.patches import framework

    ids = {p["id"] for p in checks["patches"]["data"]["patches"]}
    assert ids == {s.id for s in framework.load_series()}
    states = {p["id"]: p["state"] for p in checks["patches"]["data"]["patches"]}
    assert states["cli-buffer-only"] == "applied"
    assert states["cpu-host-pools"] == "applied"  # the test session enabled the CPU shims
    assert rc == (0 if rep["ok"] else 1)


def test_doctor_fails_on_a_world_writable_store(capsys, tmp_path) -> None:
    store = tmp_path / "shared"
    store.mkdir()
    os.chmod(store, 0o777)
    rc, rep = _run(capsys, "--store-dir", str(store))
    assert rc == 1 and not rep["ok"]
    bad = [c for c in rep["checks"] if not c["ok"]]
    assert any("writable" in c["detail"] for c in bad)


def test_doctor_fails_on_a_drifted_patch(capsys, monkeypatch) -> None:
    from sglang_l3.patches import framework

    real = framework.load_series

    def drifted(*a, **k):
        specs = real(*a, **k)
        s = next(x for x in specs if x.id == "cli-buffer-only")
        t = framework.TargetSpec(s.targets[0].path, "sha256:ffffffffffffffff")
        bad = framework.PatchSpec(**{**s.__dict__, "id": "cli-buffer-only-drifted", "targets": (t,)})
        return specs + [bad]

    monkeypatch.setattr(framework, "load_series", drifted)
    try:
        rc, rep = _run(capsys)
        patches = next(c for c in rep["checks"] if c["name"] == "patches")
        row = next(p for p in patches["data"]["patches"] if p["id"] == "cli-buffer-only-drifted")
        assert row["state"] == "drifted" and rc == 1
    finally:
        framework.undo("cli-buffer-only-drifted")


def test_text_output_names_states(capsys, tmp_path) -> None:
    ok, checks = doctor.run(store_dir=str(tmp_path / "none"))
    text = doctor.render(ok, checks, as_json=False)
    assert "cli-buffer-only" in text and "applied" in text


def test_stats_aggregate_published_counters(capsys, tmp_path, monkeypatch) -> None:
    from sglang_l3 import metrics

    monkeypatch.setenv("SGLANG_L3_STATS_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_L3_PUBLISH_STATS", "1")
    metrics.inc("recompute_fallbacks", "unit_test")
    metrics._maybe_publish(force=True)
    (tmp_path / "999999999.json").write_text('{"pid": 999999999, "counters": {"l3_restores": 5}}')  # dead pid: ignored
    cli.main(["doctor", "--json", "--stats"])
    rep = json.loads(capsys.readouterr().out)
    stats = next(c for c in rep["checks"] if c["name"] == "stats")["data"]
    # this process's counter counted once (its own published file is not added again)
    assert stats["recompute_fallbacks{unit_test}"] == metrics.get("recompute_fallbacks", "unit_test")
    # the dead pid's 5 restores are not added; earlier in-process tests may have counted their own
    assert stats.get("l3_restores", 0) == metrics.get("l3_restores")
