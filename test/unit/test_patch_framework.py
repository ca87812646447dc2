"""The patch queue refuses what it cannot verify, and says which patch and target."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import fake_patch_target as fpt
import pytest
from sglang_l3.patches import framework
from sglang_l3.patches.framework import PatchError, PatchSpec, State, TargetSpec

TARGETS = ("fake_patch_target:Greeter.hello", "fake_patch_target:Greeter.shout", "fake_patch_target:Greeter.make")


def _spec(
    pid: str,
    fingerprints: dict[str, str] | None = None,
    targets=TARGETS,
    kind: str = "AROUND+AFTER",
    requires: tuple[str, ...] = (),
) -> PatchSpec:
    fps = fingerprints or {}
    return PatchSpec(
        id=pid,
        module="fake_patch_target",
        kind=kind,
        requires=requires,
        why="test",
        upstream=(),
        retire_when="never",
        targets=tuple(TargetSpec(t, fps.get(t) or framework.fingerprint_path(t)) for t in targets),
    )


def nesting() -> list[str]:
    """The patch ids whose Greeter.hello wrapper ran, innermost first."""
    fpt.NESTING.clear()
    fpt.Greeter().hello("x")
    return list(fpt.NESTING)


@pytest.fixture
def clean():
    yield
    for pid in ("t-top", "t-ok", "t-drift", "t-missing", "t-off", "t-kind", "t-reg", "t-needs"):
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


def test_undo_keeps_a_patch_stacked_on_the_same_target(clean) -> None:
    # t-top wraps t-ok's wrapper of Greeter.hello; removing t-ok must not silently
    # remove t-top too (a negative control of one patch dropped another's hook)
    framework.apply_one(_spec("t-ok"))
    framework.apply_one(_spec("t-top"))
    assert fpt.Greeter().hello("x") == "hello x!!"
    framework.undo("t-ok")
    assert framework.is_applied("t-top") and not framework.is_applied("t-ok")
    assert fpt.Greeter().hello("x") == "hello x!"
    framework.undo("t-top")
    assert fpt.Greeter().hello("x") == "hello x"


def test_reapplying_an_undone_patch_restores_the_series_nesting(clean) -> None:
    # series order t-ok, t-top, t-needs: t-ok innermost. A negative control undoes t-ok and
    # applies it again; it must go back inside t-top and t-needs (where start-up put it),
    # not wrap them, or the rest of the suite runs a nesting no server runs.
    series = [_spec("t-ok"), _spec("t-top"), _spec("t-needs")]

    framework.apply_all(series)
    assert nesting() == ["t-ok", "t-top", "t-needs"]
    framework.undo("t-ok")
    assert nesting() == ["t-top", "t-needs"]
    framework.apply_one(series[0], series)
    assert nesting() == ["t-ok", "t-top", "t-needs"]
    assert all(framework.is_applied(s.id) for s in series)
    assert framework.apply_one(series[0], series).state is State.APPLIED  # idempotent
    assert nesting() == ["t-ok", "t-top", "t-needs"]


def test_undoing_a_patch_leaves_no_hook_of_its_dependants_behind(clean) -> None:
    # t-needs requires t-ok, t-top comes after both; all three wrap Greeter.hello. Undoing
    # t-ok removes t-needs too; t-top (applied on top of t-needs' wrapper) must not bring
    # that wrapper back when it is undone and applied again.
    series = [_spec("t-ok"), _spec("t-needs", requires=("t-ok",)), _spec("t-top")]

    framework.apply_all(series)
    assert nesting() == ["t-ok", "t-needs", "t-top"]
    assert framework.undo("t-ok") == ["t-needs"]
    assert nesting() == ["t-top"]
    assert fpt.Greeter().hello("x") == "hello x!"
    for spec in series[:2]:
        framework.apply_one(spec, series)
    assert nesting() == ["t-ok", "t-needs", "t-top"]


def test_undo_removes_the_patches_that_require_it(clean) -> None:
    # t-needs requires t-ok and stacks on its targets: re-applying it would re-apply
    # t-ok (its requirement), so the negative control would silently keep t-ok
    ok, needs = _spec("t-ok"), _spec("t-needs", requires=("t-ok",))
    framework.apply_one(needs, [ok, needs])
    assert fpt.Greeter().hello("x") == "hello x!!"
    assert framework.undo("t-ok") == ["t-needs"]
    assert not framework.is_applied("t-ok") and not framework.is_applied("t-needs")
    assert fpt.Greeter().hello("x") == "hello x"


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


def test_drifted_cosmetic_patch_is_skipped_saying_why(clean, caplog) -> None:
    """A patch that only changes what is logged (series `cosmetic = true`) does not stop
    a start where its target drifted (a torch other than the pin's): it is skipped, not
    applied, and the status and the log say why."""
    import dataclasses

    spec = dataclasses.replace(_spec("t-drift", {TARGETS[0]: "sha256:0000000000000000"}), cosmetic=True)
    with caplog.at_level("WARNING", logger="sglang_l3.patches"):
        st = framework.apply_one(spec)
    assert st.state is State.NOT_APPLICABLE
    assert "cosmetic patch skipped" in st.detail and "Greeter.hello" in st.detail
    assert fpt.Greeter().hello("x") == "hello x", "a skipped patch must change nothing"
    assert any("patch t-drift: cosmetic patch skipped" in r.getMessage() for r in caplog.records)


def test_series_cosmetic_flag_is_a_boolean(tmp_path) -> None:
    text = framework.SERIES_PATH.read_text()
    assert "cosmetic = true" in text, "quiet-extension-lock is the cosmetic patch"
    assert next(s for s in framework.load_series() if s.id == "quiet-extension-lock").cosmetic
    bad = tmp_path / "series.toml"
    bad.write_text(text.replace("cosmetic = true", 'cosmetic = "yes"'))
    with pytest.raises(PatchError, match="quiet-extension-lock.*cosmetic"):
        framework.load_series(bad)


def test_missing_target_names_patch_and_target(clean) -> None:
    spec = PatchSpec(
        "t-missing",
        "fake_patch_target",
        "AROUND",
        "t",
        (),
        "n",
        (TargetSpec("fake_patch_target:Greeter.goodbye", "sha256:0"),),
    )
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
    # Fingerprints are checked in a process that has applied nothing (this one has
    # applied the queue, and in-place registry edits change what a target hashes to).
    out = subprocess.run(
        [sys.executable, "-m", "sglang_l3.patches.fingerprint"], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, "targets drifted from the pinned upstream:\n" + "\n".join(
        line for line in out.stdout.splitlines() if not line.startswith("ok")
    )
    assert out.stdout.count("\nok") + out.stdout.startswith("ok") == sum(len(s.targets) for s in specs)


def test_declared_kind_must_match_what_apply_installs(clean) -> None:
    with pytest.raises(PatchError, match=r"t-kind.*declares kind AROUND, but apply\(\) installed AFTER\+AROUND"):
        framework.apply_one(_spec("t-kind", kind="AROUND"))
    assert framework.get_status("t-kind").state is State.FAILED
    assert fpt.Greeter().hello("x") == "hello x", "a refused patch must change nothing"


def _registry_spec() -> PatchSpec:
    return PatchSpec(
        "t-reg",
        "fake_patch_registry",
        "REGISTRY",
        "t",
        (),
        "n",
        (TargetSpec("fake_patch_target:REGISTRY", framework.fingerprint_path("fake_patch_target:REGISTRY")),),
    )


def test_requires_applies_the_required_patch_first(clean) -> None:
    reg, needs = _registry_spec(), _spec("t-needs", requires=("t-reg",))
    st = framework.apply_one(needs, [reg, needs])
    assert st.state is State.APPLIED
    assert framework.is_applied("t-reg") and fpt.REGISTRY == {"greeter": "fake"}
    assert st.as_dict()["requires"] == ["t-reg"]
    framework.undo("t-needs")
    framework.undo("t-reg")
    assert fpt.REGISTRY == {}


def test_requires_a_patch_that_is_off_makes_it_not_applicable(clean, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_L3_DISABLE", "t-reg")
    reg, needs = _registry_spec(), _spec("t-needs", requires=("t-reg",))
    out = framework.apply_all([reg, needs])
    assert [s.state for s in out] == [State.DISABLED, State.NOT_APPLICABLE]
    assert out[1].detail == "requires t-reg (disabled: SGLANG_L3_DISABLE)"
    assert fpt.Greeter().hello("x") == "hello x"


def test_series_requires_must_name_an_earlier_entry(tmp_path: Path) -> None:
    entry = """
[[patch]]
id = "{id}"
module = "m"
kind = "AROUND"
why = "w"
retire_when = "r"
requires = {req}
[[patch.target]]
path = "a:b"
fingerprint = "sha256:0"
"""
    p = tmp_path / "series.toml"
    p.write_text(entry.format(id="b", req='["a"]') + entry.format(id="a", req="[]"))
    with pytest.raises(PatchError, match="'b' requires 'a', which is not an earlier entry"):
        framework.load_series(p)
    p.write_text(
        entry.format(id="a", req="[]")
        + entry.format(id="b", req='["a"]').replace('kind = "AROUND"', 'kind = ["REGISTRY", "AFTER"]')
    )
    specs = framework.load_series(p)
    assert specs[1].requires == ("a",) and specs[1].kinds == {"REGISTRY", "AFTER"}


def test_pinned_series_declares_the_dependencies_and_kinds() -> None:
    by_id = {s.id: s for s in framework.load_series()}
    assert by_id["cpu-gdn-torch"].requires == ("cpu-host-pools",)
    assert by_id["store-file"].kinds == {"REGISTRY", "AFTER"}
    assert by_id["gptq-rocm"].kinds == {"REGISTRY", "AROUND"}
