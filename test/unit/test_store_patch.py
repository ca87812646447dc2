"""Patch store-file: `--hicache-storage-backend file` builds our store; disabling
the patch falls back to upstream's HiCacheFile."""

from __future__ import annotations

import pytest
from sglang_l3.patches import framework
from test_store_support import storage_config


def _spec():
    return next(s for s in framework.load_series() if s.id == "store-file")


def _create(tmp_path):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return StorageBackendFactory.create_backend(
        "file", storage_config(extra={"store_dir": str(tmp_path / "s"), "file_storage_path": str(tmp_path / "u")}), None
    )


@pytest.fixture
def applied():
    if not framework.is_applied("store-file"):
        framework.apply_one(_spec())
    yield
    if not framework.is_applied("store-file"):
        framework.apply_one(_spec())


def test_series_entry_targets_verify():
    spec = _spec()
    assert spec.kinds == {"REGISTRY", "AFTER"} and spec.group == "storage"
    assert framework.check_spec(spec) == {}, "upstream drifted from the fingerprints in series.toml"


def test_file_backend_is_ours(tmp_path, applied):
    from sglang_l3.storage.backend import L3FileStore

    be = _create(tmp_path)
    assert type(be) is L3FileStore and be.file_path == str(tmp_path / "s")
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    entry = StorageBackendFactory._registry["file"]
    assert (entry["module_path"], entry["class_name"]) == ("sglang_l3.storage.backend", "L3FileStore")
    be.close()


def test_undo_restores_upstream(tmp_path, applied):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    framework.undo("store-file")
    be = _create(tmp_path)
    assert type(be) is HiCacheFile


def test_disable_env_falls_back_to_upstream(tmp_path, applied, monkeypatch):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    framework.undo("store-file")
    monkeypatch.setenv("SGLANG_L3_DISABLE", "store-file")
    st = framework.apply_one(_spec())
    assert st.state == framework.State.DISABLED
    assert type(_create(tmp_path)) is HiCacheFile
    monkeypatch.delenv("SGLANG_L3_DISABLE")
    framework.undo("store-file")
    assert framework.apply_one(_spec()).state == framework.State.APPLIED
