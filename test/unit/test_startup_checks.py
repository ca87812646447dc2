"""Start-up errors at argument parsing (patch startup-checks): the store
directory and the HiCache host budget, one line naming the flag and the fix,
exit code 2. In-process through upstream's own `prepare_server_args`; the
launcher itself is exercised in test/e2e/test_startup_errors.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from sglang.srt.server_args import prepare_server_args
from sglang_l3.patches import framework
from sglang_l3.patches.cli import startup_checks
from sglang_l3.testing.server import TINY_MODEL_DIR

GiB = 1024**3
BASE = [
    "--model-path", str(TINY_MODEL_DIR), "--load-format", "dummy", "--skip-tokenizer-init",
    "--device", "cpu", "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
    "--hicache-mem-layout", "buffer_only",
]  # fmt: skip


def _spec() -> framework.PatchSpec:
    return next(s for s in framework.load_series() if s.id == "startup-checks")


@pytest.fixture(autouse=True)
def applied():
    framework.apply_one(_spec())
    yield
    framework.apply_one(_spec())  # re-apply after a negative control


def _argv(store: object, *more: str, tokens: str | None = "4096") -> list[str]:
    argv = BASE + [
        "--hicache-storage-backend-extra-config",
        json.dumps({"store_dir": str(store)}),
    ]
    if tokens is not None:
        argv += ["--max-total-tokens", tokens]
    return argv + list(more)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        prepare_server_args(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines, "no message on stderr"
    return lines[-1]


def test_store_dir_that_is_a_file(tmp_path: Path, capsys) -> None:
    f = tmp_path / "a-file"
    f.write_text("not a store")
    line = _refused(_argv(f), capsys)
    assert "store_dir" in line and str(f) in line and "not a directory" in line
    assert "Fix:" in line
    assert f.read_text() == "not a store"  # untouched


def test_world_writable_store(tmp_path: Path, capsys) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    line = _refused(_argv(d), capsys)
    assert "store_dir" in line and "world-writable" in line and f"chmod 700 {d}" in line
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o777  # refused, not "fixed" behind the user's back
    assert not (d / "pages").exists()


def test_unreadable_extra_config(tmp_path: Path, capsys) -> None:
    argv = BASE + [
        "--max-total-tokens",
        "4096",
        "--hicache-storage-backend-extra-config",
        "{store_dir: x",
    ]
    line = _refused(argv, capsys)
    assert "--hicache-storage-backend-extra-config" in line and "Fix:" in line


def test_cpu_without_max_total_tokens_leaves_no_host_memory(tmp_path: Path, capsys) -> None:
    # upstream's KV pool on --device cpu keeps only ~3.6 GiB of host memory (10 GiB
    # above 60 GiB) for everything else: always under the 10 GiB HiCache reserve
    line = _refused(_argv(tmp_path / "store", tokens=None), capsys)
    assert "--max-total-tokens" in line and "no host memory is left for HiCache" in line
    assert "Fix: pass --max-total-tokens" in line
    # an explicit host pool size does not help: the KV pool is allocated first
    line = _refused(_argv(tmp_path / "s2", "--hicache-size", "1", tokens=None), capsys)
    assert "Fix: pass --max-total-tokens" in line


def test_good_command_line_parses_and_creates_a_private_store(tmp_path: Path, monkeypatch) -> None:
    # as on a machine with room for HiCache (a shared test machine may have less
    # than the 10 GiB reserve available, and then refusing is right)
    monkeypatch.setattr(startup_checks, "_available_host_bytes", lambda: 64 * GiB)
    store = tmp_path / "store"
    sa = prepare_server_args(_argv(store))
    assert sa.hicache_host_memory_mode == "buffer_only"
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    prepare_server_args(_argv(tmp_path / "s2", "--hicache-size", "1"))


def test_no_hicache_no_checks(tmp_path: Path) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    argv = [a for a in _argv(f) if a != "--enable-hierarchical-cache"]
    prepare_server_args(argv)  # the store is not used: nothing to refuse


def test_host_budget_prediction() -> None:
    class A:
        hicache_host_memory_fraction = 0.8
        hicache_ratio = None
        hicache_size = 0
        device = "cuda"
        max_total_tokens = None
        mem_fraction_static = None
        tp_size, pp_size, nnodes = 2, 1, 1

    check = startup_checks.check_host_memory
    check(A(), available=64 * GiB, total=128 * GiB)  # GPU: the device pools are elsewhere
    with pytest.raises(startup_checks.StartupCheckError) as e:  # under the reserve: nothing fits
        check(A(), available=8 * GiB, total=16 * GiB)
    assert "--enable-hierarchical-cache" in e.value.message and "Fix: free host memory" in e.value.message
    A.hicache_size = 40  # GB per rank, 2 ranks: 80 GB > 54 GiB free beyond the reserve
    with pytest.raises(startup_checks.StartupCheckError) as e:
        check(A(), available=64 * GiB, total=128 * GiB)
    assert "--hicache-size 40" in e.value.message and "Fix: --hicache-size" in e.value.message
    A.hicache_size = 20
    check(A(), available=64 * GiB, total=128 * GiB)
    A.hicache_size, A.device = 0, "cpu"
    with pytest.raises(startup_checks.StartupCheckError) as e:  # the CPU KV pool eats the host
        check(A(), available=200 * GiB, total=256 * GiB)
    assert "--max-total-tokens" in e.value.message
    A.mem_fraction_static = 0.3  # the KV pool keeps 70 % of 64 GiB for the rest
    check(A(), available=60 * GiB, total=64 * GiB)
    A.mem_fraction_static, A.max_total_tokens = None, 4096
    check(A(), available=60 * GiB, total=64 * GiB)


def test_pinned_total_of_all_ranks() -> None:
    """2 ranks on a 64 GB box: each pins its host pools; the sum must fit the RAM
    beyond the 10 GiB reserve, and (HSA_USERPTR_FOR_PAGED_MEM=0) the free GTT."""
    check = startup_checks.check_pinned_total
    kw = {"available": 60 * GiB, "reserve": 10 * GiB, "setting": "--hicache-ratio 2"}

    def fix(scale: float) -> str:
        return f"scale {scale:.3f}"

    check(25 * GiB, 2, gtt_free=None, fix=fix, **kw)  # 50 GiB: fits
    with pytest.raises(startup_checks.StartupCheckError) as e:  # 2 x 26 > 50: one rank alone would fit
        check(26 * GiB, 2, gtt_free=None, fix=fix, **kw)
    line = e.value.message
    assert "\n" not in line and line.startswith("sglang-l3: error: --hicache-ratio 2:"), line
    assert "2 rank(s)" in line and "55.8 GB (2 x 27.9 GB" in line and "53.7 GB" in line, line
    assert f"Fix: scale {50 / 52:.3f}." in line, line
    check(26 * GiB, 1, gtt_free=None, fix=fix, **kw)
    # pools in GTT: 2 x 10 GiB fit the RAM but not 16 GiB of free GTT
    check(10 * GiB, 2, gtt_free=None, fix=fix, **kw)
    with pytest.raises(startup_checks.StartupCheckError) as e:
        check(10 * GiB, 2, gtt_free=16 * GiB, fix=fix, **kw)
    line = e.value.message
    assert "HSA_USERPTR_FOR_PAGED_MEM=0" in line and "17.2 GB of GTT is free" in line, line
    assert "Fix: unset HSA_USERPTR_FOR_PAGED_MEM" in line and "scale 0.800" in line, line
    check(8 * GiB, 2, gtt_free=16 * GiB, fix=fix, **kw)
    # under the reserve nothing fits, whatever the size: the fix is free memory, not a size
    with pytest.raises(startup_checks.StartupCheckError) as e:
        check(2 * 10**6, 1, gtt_free=None, fix=fix, available=9 * GiB, reserve=10 * GiB, setting="--hicache-ratio 2")
    line = e.value.message
    assert "2.0 MB (1 x 2.0 MB" in line and "less than HiCache's fixed 10 GiB reserve" in line, line
    assert "Fix: free host memory" in line and "scale" not in line, line


def test_fixes_name_values_that_fit() -> None:
    # --hicache-size is whole GB (argparse int): the named size must parse and fit
    assert startup_checks._size_fix(40, 0.6) == "--hicache-size 22 or less"
    assert startup_checks._size_fix(1, 0.5) == "free host memory or run without HiCache"
    assert startup_checks._ratio_fix(2.0, 0.5).startswith("--hicache-ratio 0.95 or less")
    assert startup_checks._fraction_fix(0.8, 0.5) == "--hicache-host-memory-fraction 0.38 or less"


def test_gtt_free_from_sysfs(tmp_path: Path) -> None:
    assert startup_checks.gtt_free_bytes(tmp_path) is None  # no amdgpu card
    for card, total, used in (("card0", 32 * GiB, 1 * GiB), ("card1", 32 * GiB, 5 * GiB)):
        d = tmp_path / card / "device"
        d.mkdir(parents=True)
        (d / "mem_info_gtt_total").write_text(f"{total}\n")
        (d / "mem_info_gtt_used").write_text(f"{used}\n")
    assert startup_checks.gtt_free_bytes(tmp_path) == 27 * GiB  # the least free card


def test_pools_in_gtt_only_with_userptr_off_on_hip() -> None:
    off = {"HSA_USERPTR_FOR_PAGED_MEM": "0"}
    assert startup_checks.pools_in_gtt("file", off, hip=True)
    assert startup_checks.pools_in_gtt(None, off, hip=True)
    assert not startup_checks.pools_in_gtt("file", {}, hip=True)  # default: hipHostRegister (USERPTR)
    assert not startup_checks.pools_in_gtt("file", {"HSA_USERPTR_FOR_PAGED_MEM": "1"}, hip=True)
    assert not startup_checks.pools_in_gtt("file", off, hip=False)
    assert not startup_checks.pools_in_gtt("shm", off, hip=True)  # the storage allocator owns the memory


def test_hicache_size_of_two_ranks_over_the_free_gtt(tmp_path: Path, monkeypatch, capsys) -> None:
    """The user's box: TP=2, HSA_USERPTR_FOR_PAGED_MEM=0, 2 x 20 GB > 32 GB of GTT."""
    import sglang.srt.utils

    d = tmp_path / "drm" / "card0" / "device"
    d.mkdir(parents=True)
    (d / "mem_info_gtt_total").write_text(str(32 * 10**9))
    (d / "mem_info_gtt_used").write_text("0")
    monkeypatch.setattr(startup_checks, "SYSFS_DRM", tmp_path / "drm")
    monkeypatch.setattr(startup_checks, "_available_host_bytes", lambda: 64 * GiB)
    monkeypatch.setattr(sglang.srt.utils, "is_hip", lambda: True)
    argv = _argv(tmp_path / "store", "--hicache-size", "20", "--tp-size", "2")
    prepare_server_args(argv)  # pinned from host RAM: 40 GB fit 64 GiB - 10 GiB
    monkeypatch.setenv("HSA_USERPTR_FOR_PAGED_MEM", "0")
    line = _refused(argv, capsys)
    assert line.startswith("sglang-l3: error: --hicache-size 20:") and "2 rank(s)" in line, line
    assert "40.0 GB (2 x 20.0 GB" in line and "32.0 GB of GTT is free" in line, line
    assert "Fix: unset HSA_USERPTR_FOR_PAGED_MEM" in line and "--hicache-size 15 or less" in line, line
    prepare_server_args(_argv(tmp_path / "store", "--hicache-size", "15", "--tp-size", "2"))  # the fix fits


def test_negative_control_without_patch_file_store_passes_parsing(
    tmp_path: Path,
) -> None:
    """Without the patch the launcher accepts the command line and only the
    scheduler finds the file, minutes later, with a raw traceback."""
    f = tmp_path / "a-file"
    f.write_text("x")
    framework.undo("startup-checks")
    prepare_server_args(_argv(f))  # no SystemExit
