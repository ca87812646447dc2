"""The GPU test kit's pieces that need no download (test/gpu/build_kit.py builds the
rest; docs/testing.md, "The cache path on a real GPU"): the test-only sgl_kernel shim
imports as the ~100 SGLang modules that import sgl_kernel need, binds exactly the
direct KV transfer ops, and fails loudly elsewhere; the builder's --check-only refuses
a kit that does not match its manifest."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHIM_PROBE = r"""
import sgl_kernel, sglang_l3.cpu.transfer_ops as ops
from sgl_kernel import some_kernel                      # any name imports
from sgl_kernel.flash_attn import flash_attn_varlen_func  # any submodule too
from sgl_kernel.kvcacheio import transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf
from sgl_kernel.kvcacheio import transfer_kv_all_layer_direct_lf_pf
assert transfer_kv_direct is ops.transfer_kv_direct
assert transfer_kv_per_layer_direct_pf_lf is ops.transfer_kv_per_layer_direct_pf_lf
assert transfer_kv_all_layer_direct_lf_pf is ops.transfer_kv_all_layer_direct_lf_pf
assert sgl_kernel.__version__ == "0.4.10"
for stub in (some_kernel, flash_attn_varlen_func, sgl_kernel.common_ops.rmsnorm):
    try:
        stub(1)
    except NotImplementedError as e:
        assert "GPU test kit shim" in str(e), e
    else:
        raise AssertionError(f"{stub!r} ran")
for absent in ("scalar_type", "allreduce"):
    try:
        __import__(f"sgl_kernel.{absent}")
    except ImportError as e:
        assert "on purpose" in str(e), e
    else:
        raise AssertionError(f"sgl_kernel.{absent} imported")
import torch
assert not hasattr(torch.ops.sgl_kernel, "get_device_accessible_ptr")
print("shim ok")
"""


def test_the_shim_binds_the_direct_ops_and_stubs_the_rest() -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'test/gpu/kit'}{os.pathsep}{ROOT / 'python'}")
    out = subprocess.run(
        [sys.executable, "-c", SHIM_PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0 and "shim ok" in out.stdout, out.stdout + out.stderr


def _check_only(kit: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "test/gpu/build_kit.py", "--check-only", "--out", str(kit)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_check_only_refuses_a_kit_that_does_not_match_its_manifest(tmp_path: Path) -> None:
    from sglang_l3 import SGLANG_PIN

    tarball = tmp_path / "site.tar.xz"
    tarball.write_bytes(b"kit bytes")
    manifest = {
        "sglang_pin": SGLANG_PIN,
        "shim": {"sglang_kernel_version": "0.4.10"},
        "packages": [],
        "runner": [],
        "tarball": {"file": "site.tar.xz", "bytes": 9, "sha256": hashlib.sha256(b"kit bytes").hexdigest()},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    ok = _check_only(tmp_path)
    assert ok.returncode == 0 and "build_kit: ok" in ok.stdout, ok.stdout + ok.stderr
    tarball.write_bytes(b"kit bytez")  # same size, other bytes
    bad = _check_only(tmp_path)
    assert bad.returncode == 1 and "the manifest says otherwise: rebuild" in bad.stderr, bad.stderr
    tarball.write_bytes(b"kit bytes")
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "sglang_pin": "0.0.1"}))
    bad = _check_only(tmp_path)
    assert bad.returncode == 1 and "kit is for sglang 0.0.1" in bad.stderr, bad.stderr
    old = {k: v for k, v in manifest.items() if k != "runner"}  # built before runner/ was carried
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    bad = _check_only(tmp_path)
    assert bad.returncode == 1 and "the kit predates runner/" in bad.stderr, bad.stderr
    assert _check_only(tmp_path / "nowhere").returncode == 1
