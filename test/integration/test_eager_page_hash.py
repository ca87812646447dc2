"""The page-hash extension is loaded when L3 is attached, not in the first
restore's prefetch thread (patch eager-page-hash)."""

from __future__ import annotations

import pytest
from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module
from sglang_l3.patches import framework
from sglang_l3.testing.stack import HybridSpec, L3Stack


def _spec() -> framework.PatchSpec:
    return next(s for s in framework.load_series() if s.id == "eager-page-hash")


@pytest.fixture(autouse=True)
def applied():
    framework.apply_one(_spec())
    yield
    framework.apply_one(_spec())
    _load_native_hash_module()


def _loaded_after_attach(tmp_path) -> bool:
    _load_native_hash_module.cache_clear()  # as in a fresh process
    with L3Stack(
        HybridSpec(page_size=4, kv_size=256, mamba_cache_size=8),
        str(tmp_path / "store"),
    ):
        return _load_native_hash_module.cache_info().currsize == 1


def test_loaded_when_storage_is_attached(tmp_path) -> None:
    assert _loaded_after_attach(tmp_path)


def test_negative_control_without_patch_loads_lazily(tmp_path) -> None:
    framework.undo("eager-page-hash")
    assert not _loaded_after_attach(tmp_path)
