"""Each patch's reason is written once, in patches/series.toml (why, how, upstream
refs or why none, retire_when), and upstream code is named by qualified name:
no file:line references (they go stale silently; fingerprints are per function)
in series.toml, the package's docstrings and comments, or the docs, and every
backticked qualified name there resolves in the pinned wheel."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import pytest
from sglang_l3.patches import framework

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "patches" / "series.toml",
    ROOT / "patches" / "README.md",
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "python" / "sglang_l3").rglob("*.py")),
]
LINE_REF = re.compile(r"[\w/.-]+\.py:\d+|(?:\s|\()(?::\d{2,})\b")
# torch.ops.* are kernels a machine may not have (sgl_kernel on CPU): not checked
QUALNAME = re.compile(r"`((?:sglang|torch(?!\.ops\.))(?:\.\w+)+(?::\w+(?:\.\w+)*)?)`")


def line_refs(text: str) -> list[str]:
    return [m.group(0).strip() for m in LINE_REF.finditer(text)]


def qualnames(text: str) -> list[str]:
    return QUALNAME.findall(text)


def test_every_entry_says_why_how_upstream_and_retire_when() -> None:
    for s in framework.load_series():
        assert s.why and s.how and s.retire_when, f"{s.id}: why/how/retire_when"
        assert s.upstream or s.upstream_none, f"{s.id}: upstream refs, or upstream_none saying why there are none"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_line_references(path: Path) -> None:
    text = path.read_text()
    assert line_refs(text) == [], f"{path}: name upstream code by qualified name, not file:line"


def test_backticked_qualified_names_resolve() -> None:
    names = sorted({n for p in DOCS for n in qualnames(p.read_text())})
    assert len(names) > 30, names  # the series alone names dozens
    missing = []
    for n in names:
        try:
            pkgutil.resolve_name(n)
        except Exception as e:  # ImportError, AttributeError, ValueError
            missing.append(f"{n}: {type(e).__name__}: {e}")
    assert missing == []


def test_the_checks_see_stale_references() -> None:
    assert line_refs("(models/qwen3_next.py:235, :252) and at :455") == ["models/qwen3_next.py:235", ":252", ":455"]
    assert line_refs("mode 0700, 127.0.0.1:8000, 05:36 UTC") == []
    assert qualnames("`sglang.srt.models.qwen3_next:Qwen3GatedDeltaNet.__init__` and `x.y`") == [
        "sglang.srt.models.qwen3_next:Qwen3GatedDeltaNet.__init__"
    ]
    with pytest.raises(AttributeError):
        pkgutil.resolve_name("sglang.srt.models.qwen3_next:Qwen3GatedDeltaNet.no_such_method")
