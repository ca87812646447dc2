"""The patch queue refuses what it cannot verify, and says which patch and target."""

from __future__ import annotations

import pytest

import fake_patch_target as fpt
from sglang_l3.patches import framework
from sglang_l3.patches.framework import PatchError, PatchSpec, State, TargetSpec

TARGETS = ("fake_patch_target:Greeter.hello", "fake_patch_target:Greeter.shout", "fake_patch_target:Greeter.make")


def _spec(pid: str, fingerprints: dict[str, str] | None = None, targets=TARGETS) -> PatchSpec:
    fps = fingerprints or {}
    return PatchSpec(
        id=pid,
        module="fake_patch_target",
        kind="AROUND",
        why="test",
        upstream=(),
        retire_when="never",
        targets=tuple(TargetSpec(t, fps.get(t) or framework.fingerprint_path(t)) for t in targets),
    )


@pytest.fixture
def clean():
    yield
    for pid in ("t-ok", "t-drift", "t-missing", "t-off"):
        framework.undo(pid)


def test_applies_and_records_firing(clean) -> None:
    st = framework.apply_one(_spec("t-ok"))
    assert st.state is State.APPLIED
    assert fpt.Greeter().hello("x") == "hello x!"
    assert fpt.Greeter.shout("a") == "A?"
    assert isinstance(fpt.Greeter.make(), fpt.Greeter)
    assert st.fired == {"hello": 1, "shout": 1, "make": 1}
    framework.undo("t-ok")
    assert fpt.Greeter().hello("x") == "hello x"
    assert fpt.Greeter.shout("a") == "A"


def test_fingerprint_ignores_our_own_wrapper(clean) -> None:
    before = framework.fingerprint_path(TARGETS[0])
    framework.apply_one(_spec("t-ok"))
    assert framework.fingerprint_path(TARGETS[0]) == before


def test_drifted_target_is_refused(clean, monkeypatch) -> None:
    spec = _spec("t-drift", {TARGETS[0]: "sha256:0000000000000000"})
    with pytest.raises(PatchError, match=r"t-drift.*drifted.*Greeter.hello"):
        framework.apply_one(spec)
    assert framework.get_status("t-drift").state is State.DRIFTED
    assert fpt.Greeter().hello("x") == "hello x", "a refused patch must change nothing"
    monkeypatch.setenv("SGLANG_L3_ALLOW_DRIFT", "1")
    st = framework.apply_one(spec)
    assert st.state is State.APPLIED and "drift allowed" in st.detail
    assert fpt.Greeter().hello("x") == "hello x!"


def test_missing_target_names_patch_and_target(clean) -> None:
    spec = PatchSpec("t-missing", "fake_patch_target", "AROUND", "t", (), "n",
                     (TargetSpec("fake_patch_target:Greeter.goodbye", "sha256:0"),))
    with pytest.raises(PatchError, match=r"t-missing.*fake_patch_target:Greeter.goodbye.*not found"):
        framework.apply_one(spec)


def test_hooking_an_undeclared_target_fails(clean) -> None:
    spec = _spec("t-ok", targets=TARGETS[:1])  # apply() also hooks shout/make
    with pytest.raises(PatchError, match="does not declare"):
        framework.apply_one(spec)
    assert fpt.Greeter().hello("x") == "hello x", "partial application must be undone"


def test_disable_env(clean, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_L3_DISABLE", "t-off, other")
    st = framework.apply_one(_spec("t-off"))
    assert st.state is State.DISABLED
    assert fpt.Greeter().hello("x") == "hello x"


def test_series_is_complete_and_matches_upstream() -> None:
    specs = framework.load_series()
    ids = [s.id for s in specs]
    assert len(ids) == len(set(ids))
    for s in specs:
        assert s.why and s.retire_when and s.targets
        for t in s.targets:
            assert framework.fingerprint_path(t.path) == t.fingerprint or framework.is_applied(s.id), (
                f"{s.id}: {t.path} drifted from the pinned upstream"
            )
