"""On-disk page format v1 (docs/format.md is the reference; keep them in sync).

    [0, 48)            fixed prefix (little-endian)
        0   8s  magic        b"SGL3PAGE"
        8   u16 version      1
        10  u16 flags        bit0 = payload checksummed (always set in v1)
        12  u32 header_len   payload offset; multiple of 4096 (direct IO)
        16  u64 payload_len
        24  u32 meta_len     bytes of JSON metadata at offset 48
        28  u32 n_blocks     ceil(payload_len / block_bytes)
        32  u64 block_bytes  checksum block (4 MiB in v1)
        40  u64 header_sum   xxh3_64 of [0,40) + meta + block table
    [48, 48+meta_len)  JSON metadata (key, pool, identities, chain link)
    then               n_blocks x u64 xxh3_64 of each payload block
    zero padding to header_len, then the payload (raw page bytes, the same
    bytes upstream's flat data page holds).

Torch- and sglang-free.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

MAGIC = b"SGL3PAGE"
VERSION = 1
FLAG_CHECKSUM = 1
ALIGN = 4096
BLOCK_BYTES = 4 << 20
META_MAX = 3072
PREFIX = struct.Struct("<8sHHIQIIQ")  # 40 bytes
SUM = struct.Struct("<Q")
FIXED = PREFIX.size + SUM.size  # 48
CHECKSUM_NAME = "xxh3_64"
PAGE_SUFFIX = ".bin"


class HeaderError(ValueError):
    """The header cannot be trusted; `reason` is a short machine tag."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def n_blocks_for(payload_len: int) -> int:
    return max(1, (payload_len + BLOCK_BYTES - 1) // BLOCK_BYTES)


def header_len_for(payload_len: int) -> int:
    """Deterministic per payload size, so a reader can fetch header and payload
    with one vectored read."""
    return align_up(FIXED + META_MAX + 8 * n_blocks_for(payload_len))


def file_len_for(payload_len: int) -> int:
    return header_len_for(payload_len) + payload_len


def block_hasher() -> xxhash.xxh3_64:
    """Streaming form of block_sum: update() piece by piece, then intdigest()."""
    return xxhash.xxh3_64()


def block_sum(views: Iterable[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def _meta_bytes(meta: dict[str, Any]) -> bytes:
    blob = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    if len(blob) > META_MAX and "model" in meta:
        # The digests carry the identity; the readable copy is a courtesy.
        slim = dict(meta, model={"truncated": True})
        blob = json.dumps(slim, sort_keys=True, separators=(",", ":")).encode()
    if len(blob) > META_MAX:
        raise HeaderError("meta_too_large", f"{len(blob)} > {META_MAX}")
    return blob


def encode_header(meta: dict[str, Any], payload_len: int, sums: list[int]) -> bytes:
    n_blocks = n_blocks_for(payload_len)
    if len(sums) != n_blocks:
        raise ValueError(f"expected {n_blocks} block sums, got {len(sums)}")
    hlen = header_len_for(payload_len)
    m = _meta_bytes(meta)
    prefix = PREFIX.pack(MAGIC, VERSION, FLAG_CHECKSUM, hlen, payload_len, len(m), n_blocks, BLOCK_BYTES)
    table = b"".join(SUM.pack(s) for s in sums)
    hsum = xxhash.xxh3_64_intdigest(prefix + m + table)
    body = prefix + SUM.pack(hsum) + m + table
    return body + b"\0" * (hlen - len(body))


@dataclass(frozen=True)
class Header:
    header_len: int
    payload_len: int
    block_bytes: int
    sums: tuple[int, ...]
    meta: dict[str, Any]


def decode_header(buf: bytes | memoryview, file_size: int | None = None) -> Header:
    """Parse and self-check a header. Raises HeaderError(reason)."""
    b = bytes(buf[:FIXED]) if len(buf) >= FIXED else b""
    if len(b) < FIXED:
        raise HeaderError("truncated", "shorter than the fixed header")
    magic, version, flags, hlen, plen, mlen, nblk, bbytes = PREFIX.unpack_from(b, 0)
    if magic != MAGIC:
        raise HeaderError("magic", f"not an sglang-l3 page (magic {magic!r})")
    if version != VERSION:
        raise HeaderError("version", f"format version {version}, this reader knows {VERSION}")
    if (
        hlen % ALIGN
        or hlen < FIXED + mlen + 8 * nblk
        or bbytes != BLOCK_BYTES
        or nblk != n_blocks_for(plen)
        or mlen > META_MAX
        or not flags & FLAG_CHECKSUM
    ):
        raise HeaderError("geometry", f"header_len={hlen} meta={mlen} blocks={nblk}x{bbytes}")
    end = FIXED + mlen + 8 * nblk
    if len(buf) < end:
        raise HeaderError("truncated", "header shorter than its tables")
    m = bytes(buf[FIXED : FIXED + mlen])
    table = bytes(buf[FIXED + mlen : end])
    (hsum,) = SUM.unpack_from(b, PREFIX.size)
    if xxhash.xxh3_64_intdigest(b[: PREFIX.size] + m + table) != hsum:
        raise HeaderError("header_checksum", "header bytes do not match their checksum")
    if file_size is not None and file_size != hlen + plen:
        raise HeaderError("size", f"file has {file_size} bytes, header says {hlen + plen}")
    try:
        meta = json.loads(m)
    except ValueError as e:  # checksummed, so only a writer bug gets here
        raise HeaderError("meta", str(e)) from e
    sums = tuple(SUM.unpack_from(table, 8 * i)[0] for i in range(nblk))
    return Header(hlen, plen, bbytes, sums, meta)


# --------------------------------------------------------------------------- #
# Page file names: {key}.{pool}-{pool_digest}.{model_digest}.{shard}.bin
# Different names for different identities, so two models (or dtypes, TP
# sizes) share a directory without ever opening each other's pages; the
# header repeats all of it, so a renamed or copied file is still caught.
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class PageName:
    key: str
    pool: str
    pool_digest: str
    mid: str
    shard: str

    @property
    def stem(self) -> str:
        return f"{self.key}.{self.pool}-{self.pool_digest}.{self.mid}.{self.shard}"

    @property
    def filename(self) -> str:
        return self.stem + PAGE_SUFFIX


def parse_page_name(filename: str) -> PageName | None:
    if not filename.endswith(PAGE_SUFFIX):
        return None
    parts = filename[: -len(PAGE_SUFFIX)].split(".")
    if len(parts) != 4:
        return None
    key, pool_pd, mid, shard = parts
    pool, sep, pd = pool_pd.rpartition("-")
    if not (key and sep and pool and pd and mid and shard):
        return None
    return PageName(key, pool, pd, mid, shard)
