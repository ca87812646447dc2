"""Page header v1, file names and settings (torch-free)."""

from __future__ import annotations

import struct

import pytest
from sglang_l3.storage.config import ConfigError, StoreSettings, parse_size
from sglang_l3.storage.format import (
    ALIGN,
    FIXED,
    MAGIC,
    HeaderError,
    PageName,
    decode_header,
    encode_header,
    header_len_for,
    n_blocks_for,
    parse_page_name,
)
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard, identity_for

META = {"key": "ab" * 32, "pool": "kv", "mid": "0" * 12, "shard": "r0of1", "pool_digest": "1" * 8}


def test_header_round_trip_and_alignment():
    plen = 3 * (4 << 20) + 123
    sums = [1, 2, 3, 2**64 - 1]
    h = encode_header(META, plen, sums)
    assert len(h) == header_len_for(plen) and len(h) % ALIGN == 0
    assert h[:8] == MAGIC
    d = decode_header(h, len(h) + plen)
    assert d.meta == META and d.sums == tuple(sums) and d.payload_len == plen and d.header_len == len(h)


@pytest.mark.parametrize("offset", list(range(0, 48)) + [48, 60, 100])
def test_any_header_bit_flip_is_detected(offset):
    h = bytearray(encode_header(META, 1000, [7]))
    h[offset] ^= 0x01
    with pytest.raises(HeaderError):
        decode_header(bytes(h), len(h) + 1000)


def test_size_mismatch_and_truncation():
    h = encode_header(META, 1000, [7])
    with pytest.raises(HeaderError, match="size"):
        decode_header(h, len(h) + 999)
    with pytest.raises(HeaderError, match="truncated"):
        decode_header(h[:20])


def test_other_version_is_rejected():
    h = bytearray(encode_header(META, 1000, [7]))
    struct.pack_into("<H", h, 8, 2)
    with pytest.raises(HeaderError) as e:
        decode_header(bytes(h))
    assert e.value.reason == "version"


def test_blocks():
    assert n_blocks_for(1) == 1 and n_blocks_for(4 << 20) == 1 and n_blocks_for((4 << 20) + 1) == 2
    assert header_len_for(147 << 20) == 4096  # a 147 MiB Mamba state still has a 4 KiB header
    assert FIXED == 48


def test_page_names():
    n = PageName("ab" * 32, "mamba", "deadbeef", "0123456789ab", "r1of2")
    assert parse_page_name(n.filename) == n
    for bad in ["x.bin", "a.b.c.bin", "k.kv.m.s.bin", "k.kv-pd.m.s.txt", "abc_model_0_1.bin"]:
        assert parse_page_name(bad) is None, bad


def test_identity_digests_separate_what_changes_bytes():
    base = ModelIdentity(model="m", kv_cache_dtype="bfloat16", tp_size=2)
    assert base.digest() == ModelIdentity(model="m", kv_cache_dtype="bfloat16", tp_size=2).digest()
    for change in [
        dict(kv_cache_dtype="float16"),
        dict(tp_size=4),
        dict(model="n"),
        dict(quantization="gptq"),
        dict(weights="rev:x"),
        dict(page_size=32),
        dict(mem_layout="page_first_direct"),
    ]:
        assert ModelIdentity(**{**base.as_dict(), **change}).digest() != base.digest(), change
    a = PoolLayout("kv", "page_first", 64, (("bfloat16", (2, 64, 8, 4, 128)),), 1 << 20)
    b = PoolLayout("kv", "page_first", 64, (("float16", (2, 64, 8, 4, 128)),), 1 << 20)
    assert a.digest() != b.digest() and a.element_count == 2 * 64 * 8 * 4 * 128
    assert Shard(tp_rank=1, tp_size=2).name() == "r1of2" and Shard(tp_size=2).name(replicated=True) == "rall"


def test_identity_for_storage_config_and_server_args(tmp_path):
    class Cfg:
        tp_rank, tp_size, pp_rank, pp_size, attn_cp_rank, attn_cp_size = 1, 2, 0, 1, 0, 1
        is_mla_model, model_name, dcp_size, dcp_rank = False, "org/m", 1, 0

    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)

    class SA:
        model_path, revision, quantization, dtype = str(tmp_path), None, "gptq", "float16"
        kv_cache_dtype, mamba_ssm_dtype, load_format, page_size, hicache_mem_layout = (
            "auto",
            "float32",
            "auto",
            64,
            "page_first",
        )

    m, s = identity_for(Cfg(), SA())
    assert (m.model, m.quantization, m.dtype, m.page_size, m.tp_size) == ("org/m", "gptq", "float16", 64, 2)
    assert m.model_config != "unknown" and m.weights.startswith("files:")
    assert s.name() == "r1of2"
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)  # re-quantized weights
    assert identity_for(Cfg(), SA())[0].digest() != m.digest()


def test_parse_size():
    assert parse_size("200G") == 200 * 10**9 and parse_size("180Gi") == 180 * 2**30
    assert parse_size("1GiB") == 2**30 and parse_size(1234) == 1234 and parse_size("") == 0
    assert parse_size("5%", fs_total=1000) == 50
    for bad in ["-1", "abc", "5%%", True]:
        with pytest.raises(ConfigError):
            parse_size(bad, fs_total=100)


def test_settings_precedence(tmp_path):
    env = {
        "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/up",
        "SGLANG_L3_STORE_DIR": "/ours",
        "SGLANG_L3_STORE_MAX_BYTES": "10Gi",
        "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "1G",
        "SGLANG_L3_STORE_DURABILITY": "batch",
        "SGLANG_L3_STORE_ODIRECT": "0",
        "SGLANG_L3_STORE_MIN_FREE_BYTES": "1G",
    }
    s = StoreSettings.resolve({}, env=env)
    assert (str(s.root), s.max_bytes, s.durability, s.odirect, s.min_free) == (
        "/ours",
        10 * 2**30,
        "batch",
        "off",
        "1G",
    )
    s = StoreSettings.resolve({"store_dir": "/x", "max_bytes": "2G", "durability": "none", "odirect": True}, env=env)
    assert (str(s.root), s.max_bytes, s.durability, s.odirect) == ("/x", 2 * 10**9, "none", "on")
    up = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/up", "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "1G"}
    s = StoreSettings.resolve({}, env=up)
    assert str(s.root) == "/up" and s.max_bytes == 10**9  # upstream's variables keep working
    s = StoreSettings.resolve({"file_storage_path": "/fsp", "max_size": "3G"}, env={})
    assert str(s.root) == "/fsp" and s.max_bytes == 3 * 10**9  # upstream's extra-config keys too
    with pytest.raises(ConfigError):
        StoreSettings.resolve({"durability": "always"}, env={})
    with pytest.raises(ConfigError):
        StoreSettings.resolve({"odirect": "maybe"}, env={})
