"""The IO engine's data path (issue 18): buffered reads land and are hashed in
pieces, workers pull blocks off one list (the caller is one of them), and a
buffered batch runs on at most one worker per CPU. Every byte is still
checked: a flipped byte in any piece of any block is a miss + quarantine."""

from __future__ import annotations

import os

import pytest
from sglang_l3.storage import io_engine
from sglang_l3.storage.config import StoreSettings
from sglang_l3.storage.format import BLOCK_BYTES, decode_header, header_len_for
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
from sglang_l3.storage.store import PageStore, ReadItem, WriteItem

# 3 checksum blocks + a tail that is no multiple of 4 KiB: buffered IO even
# where O_DIRECT works, and pieces that end mid-run and mid-block.
PAGE = 2 * BLOCK_BYTES + 3 * io_engine._READ_PIECE + 12345


def _store(root, threads: int, odirect: str = "auto") -> tuple[PageStore, object]:
    st = PageStore(
        StoreSettings(root=root, min_free="0", io_threads=threads, odirect=odirect),
        ModelIdentity(model="pieces"),
        Shard(),
        sweep_strays=False,
    )
    return st, st.pool_spec(PoolLayout("kv", "raw", 1, (("uint8", (PAGE,)),), PAGE))


def _runs(buf: bytearray, cuts: list[int]) -> list[memoryview]:
    """Runs that split the page at odd offsets (K/V halves, Mamba tensors)."""
    mv, out, prev = memoryview(buf), [], 0
    for c in cuts + [len(buf)]:
        out.append(mv[prev:c])
        prev = c
    return out


CUTS = [
    1000,
    io_engine._READ_PIECE + 7,
    BLOCK_BYTES - 1,
    BLOCK_BYTES + 5 * 4096,
    2 * BLOCK_BYTES + 1,
]


def _write(st, spec, n: int, seed: int) -> tuple[list[str], list[bytes]]:
    keys, datas, items = [], [], []
    for i in range(n):
        key = f"{seed:02x}{i:062x}"
        data = bytearray(os.urandom(PAGE))
        keys.append(key)
        datas.append(bytes(data))
        items.append(WriteItem(key, spec, _runs(data, CUTS)))
    assert st.write(items) == [True] * n
    return keys, datas


def _read(st, spec, keys) -> tuple[list[bool], list[bytearray]]:
    bufs = [bytearray(PAGE) for _ in keys]
    ok = st.read([ReadItem(k, spec, _runs(b, CUTS)) for k, b in zip(keys, bufs, strict=True)])
    return ok, bufs


@pytest.mark.parametrize("threads", [1, 2, 32])
def test_buffered_pieces_round_trip_bit_exact(tmp_path, threads):
    st, spec = _store(tmp_path / "s", threads)
    keys, datas = _write(st, spec, 5, threads)
    ok, bufs = _read(st, spec, keys)
    assert ok == [True] * 5
    assert [bytes(b) for b in bufs] == datas
    c = st.counters.snapshot()
    assert c["read_hits"] == 5 and "read_direct" not in c  # the buffered path ran
    st.close()


@pytest.mark.parametrize(
    "where",
    [
        "first byte",
        "second piece of block 0",
        "last piece of block 0",
        "middle of block 1",
        "last byte",
    ],
)
def test_a_flipped_byte_in_any_piece_is_a_miss(tmp_path, where):
    st, spec = _store(tmp_path / "s", 4)
    keys, datas = _write(st, spec, 3, 7)
    offset = {
        "first byte": 0,
        "second piece of block 0": io_engine._READ_PIECE + 3,
        "last piece of block 0": BLOCK_BYTES - 2,
        "middle of block 1": BLOCK_BYTES + BLOCK_BYTES // 2 + 1,
        "last byte": PAGE - 1,
    }[where]
    path = st.path_of(keys[1], spec)
    with open(path, "r+b") as f:
        f.seek(header_len_for(PAGE) + offset)
        b = f.read(1)
        f.seek(header_len_for(PAGE) + offset)
        f.write(bytes([b[0] ^ 0x01]))
    ok, bufs = _read(st, spec, keys)
    assert ok == [True, False, True]
    assert bytes(bufs[0]) == datas[0] and bytes(bufs[2]) == datas[2]
    c = st.counters.snapshot()
    assert c.get("quarantined_checksum") == 1, c
    assert not os.path.exists(path)
    st.close()


def test_block_checksums_are_those_of_whole_blocks(tmp_path):
    """Piecewise hashing is an implementation detail: the header still holds
    xxh3_64 of each whole 4 MiB block (format v1 unchanged)."""
    import xxhash

    st, spec = _store(tmp_path / "s", 2)
    keys, datas = _write(st, spec, 1, 9)
    with open(st.path_of(keys[0], spec), "rb") as f:
        raw = f.read()
    h = decode_header(raw[: header_len_for(PAGE)], len(raw))
    payload = raw[header_len_for(PAGE) :]
    assert payload == datas[0]
    assert list(h.sums) == [xxhash.xxh3_64_intdigest(payload[i : i + BLOCK_BYTES]) for i in range(0, PAGE, BLOCK_BYTES)]
    st.close()


def test_buffered_batches_use_at_most_one_worker_per_cpu(tmp_path, monkeypatch):
    st, spec = _store(tmp_path / "s", 32, odirect="off")
    seen: set[int] = set()
    real = os.preadv

    def spy(fd, views, off):
        import threading

        seen.add(threading.get_ident())
        return real(fd, views, off)

    keys, datas = _write(st, spec, 6, 3)
    monkeypatch.setattr(os, "preadv", spy)
    ok, bufs = _read(st, spec, keys)
    assert ok == [True] * 6 and [bytes(b) for b in bufs] == datas
    assert 1 <= len(seen) <= max(1, len(os.sched_getaffinity(0)))
    st.close()


def test_an_error_in_one_block_fails_only_its_page(tmp_path, monkeypatch):
    st, spec = _store(tmp_path / "s", 3)
    keys, datas = _write(st, spec, 3, 5)
    bad = os.path.basename(st.path_of(keys[1], spec))
    real = os.preadv
    fds: set[int] = set()
    real_open = os.open

    def tracking_open(path, flags, mode=0o777, **kw):
        fd = real_open(path, flags, mode, **kw)
        if os.path.basename(path) == bad:
            fds.add(fd)
        return fd

    def failing(fd, views, off):
        if fd in fds and off >= BLOCK_BYTES:
            raise OSError(5, "injected EIO")
        return real(fd, views, off)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "preadv", failing)
    ok, bufs = _read(st, spec, keys)
    assert ok == [True, False, True]
    assert bytes(bufs[0]) == datas[0] and bytes(bufs[2]) == datas[2]
    assert st.counters.get("read_errors") == 1
    assert os.path.exists(st.path_of(keys[1], spec)), "an IO error is not corruption: the page stays"
    st.close()
