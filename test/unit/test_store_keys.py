"""Keys, pool names and model identities are validated with fullmatch (issue
17): `$` accepted a trailing newline, so `set("x\\n")` created `pages/x\\n.kv-….bin`.
Every entry point of SGLang's storage interface refuses every bad key the same
way: a miss / False, no file created, `invalid_keys` counted."""

from __future__ import annotations

import os

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_l3.storage.config import ConfigError, StoreSettings
from sglang_l3.storage.safety import (
    valid_identity_override,
    valid_key,
    valid_mid,
    valid_model_arg,
    valid_name,
    valid_pool,
)
from test_store_support import (
    fill_random,
    keys,
    make_kv_pool,
    make_mamba_pool,
    make_store,
)

BAD_KEYS = [
    "x\n",
    "x\r",
    "\nx",
    "a\0b",
    "a/b",
    "/etc/passwd",
    "..",
    "../x",
    "",
    "a" * 129,
    "ключ",
    "é",
    "a b",
    "a.b",
    "x\n\n",
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_validators_refuse(key):
    assert not valid_key(key)
    assert not valid_pool(key)
    assert not valid_mid(key)
    assert not valid_name(key) or key in ("a.b", "a" * 129)  # fine as file names, not as keys


def test_validators_accept():
    assert valid_key("a" * 128) and valid_key("abc_DEF-123") and valid_pool("kv") and valid_pool("mamba")
    assert valid_mid("0123456789ab") and not valid_mid("0123456789ab\n") and not valid_mid("0123456789AB")
    assert valid_model_arg("org/model-a") and valid_model_arg("/models/Qwen3-Next-80B") and valid_model_arg("08616d")
    for bad in ("x\n", "", "/", "a/../b", "..", "a b", "é", "a\0b"):
        assert not valid_model_arg(bad), bad
    assert valid_identity_override("") and valid_identity_override("ft-2026.1")
    assert not valid_identity_override("x\n")


def test_identity_override_refused_at_settings(tmp_path):
    with pytest.raises(ConfigError, match="model_identity"):
        StoreSettings.resolve({"store_dir": str(tmp_path), "model_identity": "v1\n"})


def _idx(pages, page_size, start_page=0):
    return torch.arange(start_page * page_size, (start_page + pages) * page_size, dtype=torch.int64)


def _entry_points(st, kv, key):
    """Every way SGLang hands a key to the store: name -> result that must be a miss/False."""
    ps = kv.page_size
    page = kv.get_data_page(0, flat=True).contiguous().clone()
    mamba = PoolTransfer(
        name=PoolName.MAMBA,
        host_indices=torch.tensor([0]),
        keys=[key],
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )
    return {
        "set": lambda: st.set(key, page),
        "batch_set": lambda: st.batch_set([key], [page]),
        "get": lambda: st.get(key, kv.get_dummy_flat_data_page()) is not None,
        "batch_get": lambda: st.batch_get([key], [kv.get_dummy_flat_data_page()])[0] is not None,
        "exists": lambda: st.exists(key),
        "batch_exists": lambda: st.batch_exists([key]) > 0,
        "batch_set_v1": lambda: st.batch_set_v1([key], _idx(1, ps))[0],
        "batch_get_v1": lambda: st.batch_get_v1([key], _idx(1, ps, 1))[0],
        "batch_set_v2": lambda: any(
            any(v)
            for v in st.batch_set_v2(
                [
                    PoolTransfer(name=PoolName.KV, host_indices=_idx(1, ps), keys=[key]),
                    mamba,
                ]
            ).values()
        ),
        "batch_get_v2": lambda: any(
            any(v)
            for v in st.batch_get_v2(
                [
                    PoolTransfer(name=PoolName.KV, host_indices=_idx(1, ps, 1), keys=[key]),
                    mamba,
                ]
            ).values()
        ),
        "batch_exists_v2": lambda: st.batch_exists_v2([key], [mamba]).kv_hit_pages > 0,
    }


def test_every_entry_point_refuses_every_bad_key(tmp_path):
    kv, mb = make_kv_pool(), make_mamba_pool()
    fill_random(kv, 1)
    fill_random(mb, 2)
    st = make_store(tmp_path, kv=kv, mamba=mb)
    good = keys(1)[0]
    # The table works: a good key goes through every entry point.
    assert all(f() for name, f in _entry_points(st, kv, good).items() if "set" in name)
    assert all(f() for name, f in _entry_points(st, kv, good).items() if "set" not in name)
    before = sorted(os.listdir(tmp_path / "pages"))
    refused = 0
    for key in BAD_KEYS:
        for name, f in _entry_points(st, kv, key).items():
            assert f() is False, f"{name}({key!r}) was not refused"
            refused += 1
    assert sorted(os.listdir(tmp_path / "pages")) == before, "a bad key created a file"
    assert os.listdir(tmp_path / "tmp") == []
    assert st.store.counters.get("invalid_keys") >= refused
    assert st.store.counters.get("api_errors") == 0
    st.close()
