"""One source for the upstream pin (sglang_l3.SGLANG_PIN), every SGLANG_L3_*
variable declared in sglang_l3/envs.py and documented, the license declared."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from sglang_l3 import SGLANG_PIN, envs

ROOT = Path(__file__).resolve().parents[2]
VAR = re.compile(r"SGLANG_L3_[A-Z0-9_]*[A-Z0-9]\b")


def test_pyproject_pins_sglang_pin() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"sglang=={SGLANG_PIN}" in meta["dependencies"]
    assert meta["requires-python"] == ">=3.11"
    assert meta["license"] == "Apache-2.0"  # SPDX expression (PEP 639)
    assert "LICENSE" in meta.get("license-files", ["LICENSE"])
    assert (ROOT / "LICENSE").read_text().startswith(
        "\n                                 Apache License"
    ) or "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_no_other_copy_of_the_pin() -> None:
    """Makefile and device_check.sh read SGLANG_PIN; no literal version there."""
    for rel in ("Makefile", "test/gpu/device_check.sh", "test/unit/test_doctor.py", ".ci/run"):
        text = (ROOT / rel).read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert SGLANG_PIN not in code, f"{rel} repeats the pin; read sglang_l3.SGLANG_PIN"
    assert "python/sglang_l3/__init__.py" in (ROOT / "Makefile").read_text()


def _sources() -> list[Path]:
    files = [
        *ROOT.joinpath("python").rglob("*.py"),
        *ROOT.joinpath("benchmark").rglob("*.py"),
        *ROOT.joinpath("test").rglob("*.py"),
        *ROOT.joinpath("test").rglob("*.sh"),
        ROOT / "Makefile",
        ROOT / ".ci" / "run",
    ]
    return [p for p in files if p.name != "envs.py"]


def test_every_variable_is_declared() -> None:
    used = {m for p in _sources() for m in VAR.findall(p.read_text())}
    undeclared = sorted(used - set(envs.VARS))
    assert undeclared == [], f"declare these in sglang_l3/envs.py: {undeclared}"


def test_every_declared_variable_is_documented() -> None:
    ops = (ROOT / "docs" / "operations.md").read_text()
    section = ops[ops.index("## Environment variables") :]
    missing = [n for n in envs.VARS if f"`{n}`" not in section]
    assert missing == []


def test_value_and_flag(monkeypatch) -> None:
    monkeypatch.delenv("SGLANG_L3_STRICT", raising=False)
    assert envs.value("SGLANG_L3_STRICT") == "1"
    monkeypatch.setenv("SGLANG_L3_ALLOW_DRIFT", "yes")
    assert envs.flag("SGLANG_L3_ALLOW_DRIFT")
    monkeypatch.setenv("SGLANG_L3_ALLOW_DRIFT", "")
    assert not envs.flag("SGLANG_L3_ALLOW_DRIFT")
