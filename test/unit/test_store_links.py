"""No link is ever followed (issue 17): a symbolic link, directory, FIFO or
another user's file at a page's name is damage - never served, moved to
quarantine (the link itself; its target's bytes and mtime untouched), and the
page is rewritten by the next write."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
from sglang_l3.storage.store import PageStore, ReadItem, WriteItem

PAYLOAD = 3 * 4096 + 100


def _open(root, model="m"):
    st = PageStore(
        StoreSettings(root=root, min_free="0"),
        ModelIdentity(model=model),
        Shard(),
        sweep_strays=False,
    )
    return st, st.pool_spec(PoolLayout("kv", "raw", 1, (("uint8", (PAYLOAD,)),), PAYLOAD))


def _key(s="page"):
    return hashlib.sha256(s.encode()).hexdigest()


def _data(tag: bytes) -> bytearray:
    return bytearray((tag * (PAYLOAD // len(tag) + 1))[:PAYLOAD])


def _make_target(kind, tmp_path, key):
    """Something outside the store for a link to point at; returns its path."""
    out = tmp_path / "outside"
    out.mkdir()
    if kind == "forged":  # a well-formed page of the same model and key, from another store
        other, spec = _open(tmp_path / "other")
        assert other.write([WriteItem(key, spec, [memoryview(_data(b"FORGED"))])]) == [True]
        other.close()
        return other.path_of(key, spec)
    if kind == "garbage":
        p = out / "garbage"
        _, spec = _open(tmp_path / "probe")
        p.write_bytes(os.urandom(spec.file_len))  # the right size: only the link check stops it
        return str(p)
    if kind == "directory":
        (out / "dir").mkdir()
        return str(out / "dir")
    if kind == "fifo":
        os.mkfifo(out / "fifo")
        return str(out / "fifo")
    return str(out / "dangling")


def _snapshot(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    body = Path(path).read_bytes() if stat.S_ISREG(st.st_mode) else None
    return st.st_mtime_ns, st.st_mode, body


def _quarantined(root, reason):
    return [n for n in os.listdir(root / "quarantine") if f"-{reason}-" in n]


@pytest.mark.parametrize("kind", ["forged", "garbage", "directory", "fifo", "dangling"])
def test_link_at_page_name_never_served_quarantined_rewritten(tmp_path, kind):
    root = tmp_path / "store"
    st, spec = _open(root)
    key = _key()
    target = _make_target(kind, tmp_path, key)
    before = _snapshot(target)
    name = st.path_of(key, spec)

    # exists(): a link is not a stored page; it is moved aside.
    os.symlink(target, name)
    assert st.exists([(key, spec)]) == [False]
    assert not os.path.lexists(name)
    q = _quarantined(root, "link")
    assert len(q) == 1 and os.path.islink(root / "quarantine" / q[0])

    # read(): never serves the target's bytes, even a well-formed forged page.
    os.symlink(target, name)
    buf = bytearray(b"\x5a" * PAYLOAD)
    assert st.read([ReadItem(key, spec, [memoryview(buf)])]) == [False]
    assert bytes(buf) == b"\x5a" * PAYLOAD
    assert not os.path.lexists(name) and len(_quarantined(root, "link")) == 2

    # write(): a link planted at the name does not make the write a no-op.
    os.symlink(target, name)
    want = _data(b"REAL")
    assert st.write([WriteItem(key, spec, [memoryview(want)])]) == [True]
    assert stat.S_ISREG(os.lstat(name).st_mode)
    got = bytearray(PAYLOAD)
    assert st.read([ReadItem(key, spec, [memoryview(got)])]) == [True] and got == want
    assert st.counters.get("write_skipped_existing") == 0

    assert _snapshot(target) == before, "the link's target was touched"
    assert st.counters.get("quarantined_link") >= 2
    st.close()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_special_file_at_page_name_is_damage(tmp_path, kind):
    root = tmp_path / "store"
    st, spec = _open(root)
    key = _key()
    name = st.path_of(key, spec)
    for probe in ("exists", "read"):
        os.mkdir(name) if kind == "directory" else os.mkfifo(name)
        if probe == "exists":
            assert st.exists([(key, spec)]) == [False]
        else:  # a FIFO must not hang the reader
            assert st.read([ReadItem(key, spec, [memoryview(bytearray(PAYLOAD))])]) == [False]
        assert not os.path.lexists(name)
    reason = "directory" if kind == "directory" else "special"
    assert len(_quarantined(root, reason)) == 2
    assert st.write([WriteItem(key, spec, [memoryview(_data(b"x"))])]) == [True]
    assert st.exists([(key, spec)]) == [True]
    st.close()


def test_another_users_file_at_page_name_is_not_served(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a file to another user")
    root = tmp_path / "store"
    st, spec = _open(root)
    key = _key()
    assert st.write([WriteItem(key, spec, [memoryview(_data(b"A"))])]) == [True]
    name = st.path_of(key, spec)
    os.chown(name, 65534, 65534)
    assert st.read([ReadItem(key, spec, [memoryview(bytearray(PAYLOAD))])]) == [False]
    assert _quarantined(root, "foreign")
    assert st.write([WriteItem(key, spec, [memoryview(_data(b"A"))])]) == [True]
    assert os.lstat(name).st_uid == 0
    st.close()


def test_hard_link_to_a_page_elsewhere_does_not_redirect_writes(tmp_path):
    """A page replaced by a link after the write: the next write renames over
    the link; the outside file keeps its bytes."""
    root = tmp_path / "store"
    st, spec = _open(root)
    key = _key()
    outside = tmp_path / "victim"
    outside.write_bytes(b"do not touch")
    name = st.path_of(key, spec)
    os.symlink(outside, name)
    assert st.write([WriteItem(key, spec, [memoryview(_data(b"B"))])]) == [True]
    assert outside.read_bytes() == b"do not touch"
    assert stat.S_ISREG(os.lstat(name).st_mode)
    st.close()


def test_stray_sweep_quarantines_links_at_page_names(tmp_path):
    root = tmp_path / "store"
    st, spec = _open(root)
    key = _key()
    target = tmp_path / "t"
    target.write_bytes(b"x")
    os.symlink(target, st.path_of(key, spec))
    st._sweep_strays()
    assert _quarantined(root, "link") and target.read_bytes() == b"x"
    st.close()


def test_links_in_tmp_are_removed_not_followed(tmp_path):
    root = tmp_path / "store"
    st, _ = _open(root)
    st.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, root / "tmp" / "999999999-x.tmp")
    st, _ = _open(root)
    assert os.listdir(root / "tmp") == [] and victim.read_bytes() == b"keep"
    st.close()


def test_manifest_link_is_replaced_not_written_through(tmp_path):
    root = tmp_path / "store"
    st, _ = _open(root)
    mid = st.mid
    st.close()
    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    man = root / "models" / f"{mid}.json"
    man.unlink()
    os.symlink(victim, man)
    st, _ = _open(root)
    assert victim.read_text() == "keep" and not os.path.islink(man)
    st.close()


def test_helpers_for_tables_added_later(tmp_path):
    """A later table (e.g. sessions/) gets the same rules through safety's helpers."""
    from sglang_l3.storage.safety import (
        UnsafeStoreError,
        read_store_file,
        replace_store_file,
    )

    root = tmp_path / "store"
    replace_store_file(root, "sessions", "m.json", b"{}")
    assert read_store_file(root, "sessions", "m.json") == b"{}"
    assert stat.S_IMODE(os.stat(root / "sessions").st_mode) == 0o700
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (root / "sessions" / "m.json").unlink()
    os.symlink(victim, root / "sessions" / "m.json")
    assert read_store_file(root, "sessions", "m.json") is None  # a link is not read
    replace_store_file(root, "sessions", "m.json", b"[]")  # ... and is replaced, not written through
    assert victim.read_bytes() == b"keep" and read_store_file(root, "sessions", "m.json") == b"[]"
    os.chmod(root / "sessions", 0o777)
    with pytest.raises(UnsafeStoreError, match="sessions"):
        read_store_file(root, "sessions", "m.json")
    with pytest.raises(UnsafeStoreError, match="sessions"):
        _open(root)  # the server refuses a store with an unsafe table directory too


def test_link_at_the_writer_lock_name_is_replaced(tmp_path):
    root = tmp_path / "store"
    st, _ = _open(root)
    st.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    lock = root / "locks" / f"{os.getpid()}.lock"
    lock.unlink()  # left by the closed store; plant a link in its place
    os.symlink(victim, lock)
    st, _ = _open(root)
    assert not os.path.islink(root / "locks" / f"{os.getpid()}.lock") and victim.read_bytes() == b"keep"
    st.close()
