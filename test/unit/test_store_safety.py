"""The store directory is private: created 0700, foreign or group/world-
writable directories are refused at start-up with a message that says why."""

from __future__ import annotations

import os
import stat

import pytest
from sglang_l3.storage.config import StoreSettings, default_store_dir
from sglang_l3.storage.identity import ModelIdentity, Shard
from sglang_l3.storage.safety import UnsafeStoreError, ensure_store_dir, valid_key
from sglang_l3.storage.store import PageStore


def _open(root):
    return PageStore(StoreSettings(root=root, min_free="0"), ModelIdentity(model="m"), Shard(), sweep_strays=False)


def test_created_private_even_with_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        root = tmp_path / "a" / "store"
        st = _open(root)
    finally:
        os.umask(old)
    for d in (root, root / "pages", root / "tmp", root / "quarantine", root / "models"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    st.close()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_group_or_world_writable_is_refused(tmp_path, mode):
    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(UnsafeStoreError, match="writable.*chmod 700"):
        _open(root)
    assert not (root / "pages").exists()  # nothing created inside


def test_readable_by_others_is_allowed(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, 0o755)
    _open(root).close()


def test_directory_of_another_user_is_refused(tmp_path):
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    try:
        os.chown(root, 65534, 65534)
    except PermissionError:
        pytest.skip("needs root to hand a directory to another user")
    with pytest.raises(UnsafeStoreError, match="owned by .*uid 65534"):
        _open(root)


def test_subdirectory_of_another_user_is_refused(tmp_path):
    root = tmp_path / "store"
    ensure_store_dir(root)
    try:
        os.chown(root / "pages", 65534, 65534)
    except PermissionError:
        pytest.skip("needs root")
    with pytest.raises(UnsafeStoreError, match="pages"):
        _open(root)


def test_world_writable_parent_without_sticky_bit_is_refused(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)
    if os.geteuid() == 0:
        os.chown(parent, 65534, 65534)  # another user's world-writable directory
    with pytest.raises(UnsafeStoreError, match="sticky"):
        _open(parent / "store")
    os.chmod(parent, 0o1777)  # like /tmp: others cannot rename our directory
    _open(parent / "store").close()


def test_backend_refuses_at_start_up(tmp_path):
    from test_store_support import make_store

    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeStoreError):
        make_store(root)


def test_default_location_is_user_cache_not_tmp(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_store_dir() == tmp_path / ".cache" / "sglang-l3" / "store"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_store_dir() == tmp_path / "xdg" / "sglang-l3" / "store"
    env = {"HOME": str(tmp_path)}
    assert not str(StoreSettings.resolve({}, env=env).root).startswith("/tmp/hicache")


def test_key_validation():
    assert valid_key("a" * 64) and valid_key("abc_DEF-123")
    for k in ["../x", "/etc/passwd", "a/b", "..", ".hidden", "", "a" * 129, "a\0b", "k.pool", None, 5]:
        assert not valid_key(k), k
