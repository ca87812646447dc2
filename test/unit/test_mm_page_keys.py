"""Patches mm-grid-hash and mm-hashes-guard on upstream's real classes, in process
(the server-level checks, with negative controls, are in test/e2e/test_images_server.py).

mm-grid-hash: two image items whose processor features are identical but whose
grids differ (Qwen's processor gives that for a 64x32 image of blocks P over Q
and a 32x64 one of P beside Q) get different hashes and pad values; upstream
alone gives them the same ones (negative control: the patch undone).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, Req
from sglang.srt.mem_cache.utils import storage_namespace_seed
from sglang.srt.multimodal.cache.identity import resolve_multimodal_item_hash
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang_l3.live_config import l3_attached
from sglang_l3.patches import framework
from sglang_l3.patches.serving.lora_key_namespace import client_key, namespace_extra_key
from sglang_l3.patches.serving.mm_grid_hash import folded_hash
from sglang_l3.patches.serving.mm_hashes_guard import REFUSAL, check_request, identity_key_in, supplied


def _spec(pid: str) -> framework.PatchSpec:
    return next(s for s in framework.load_series() if s.id == pid)


@pytest.fixture
def without_grid_hash():
    framework.undo("mm-grid-hash")
    yield
    framework.apply_one(_spec("mm-grid-hash"))


def _transposed_pair() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pixel_values, grid) of the two images, from the packaged tiny Qwen3.5's own
    image processor."""
    from PIL import Image
    from sglang_l3.testing.server import model_dir
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(str(model_dir("tiny-qwen35")))
    rng = np.random.default_rng(7)
    p, q = (rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(2))
    outs = [proc(images=[Image.fromarray(np.concatenate([p, q], axis=ax))], return_tensors="pt") for ax in (0, 1)]
    (a, b) = outs
    return a["pixel_values"], a["image_grid_thw"], b["pixel_values"], b["image_grid_thw"]


def _item(feature: torch.Tensor, grid: torch.Tensor, modality: Modality = Modality.IMAGE) -> MultimodalDataItem:
    item = MultimodalDataItem(modality=modality, feature=feature)
    item.set(f"{modality.name.lower()}_grid_thw", grid)
    item.set_pad_value()
    return item


def test_same_pixels_different_grid_get_different_pads() -> None:
    fa, ga, fb, gb = _transposed_pair()
    assert torch.equal(fa, fb) and not torch.equal(ga, gb)  # the premise: upstream's hash input is equal
    a, b = _item(fa, ga), _item(fb, gb)
    assert a.hash != b.hash
    assert set(a.padding_values()).isdisjoint(b.padding_values())
    # same image again: same pads (a cache hit stays a hit)
    assert _item(fa.clone(), ga.clone()).padding_values() == a.padding_values()


def test_negative_control_upstream_gives_them_the_same_pads(without_grid_hash) -> None:
    fa, ga, fb, gb = _transposed_pair()
    assert _item(fa, ga).padding_values() == _item(fb, gb).padding_values()


def test_hash_set_elsewhere_is_kept() -> None:
    # the preprocess-cache path sets the hash from its artifact key (set_hash): kept
    item = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.zeros(4, 8))
    item.set("image_grid_thw", torch.tensor([[1, 2, 2]]))
    item.set_hash(12345)
    pads = item.padding_values()
    item.set_pad_value()
    assert item.hash == 12345 and item.padding_values() == pads


def test_item_without_position_metadata_keeps_upstream_hash() -> None:
    feature = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    item = MultimodalDataItem(modality=Modality.AUDIO, feature=feature)
    item.set_pad_value()
    assert item.hash == resolve_multimodal_item_hash(feature=feature)


def test_video_timing_is_part_of_the_hash() -> None:
    feature = torch.ones(8, 16)
    a = MultimodalDataItem(modality=Modality.VIDEO, feature=feature)
    a.set("video_grid_thw", torch.tensor([[2, 2, 2]]))
    a.set("second_per_grid_ts", [1.0])
    b = MultimodalDataItem(modality=Modality.VIDEO, feature=feature.clone())
    b.set("video_grid_thw", torch.tensor([[2, 2, 2]]))
    b.set("second_per_grid_ts", [2.0])
    a.set_pad_value()
    b.set_pad_value()
    assert a.hash != b.hash


def test_a_transferred_item_keeps_its_pads() -> None:
    # the scheduler receives the tokenizer's items (pad values set) and calls
    # set_pad_value again (MultimodalInputs.from_processor_output): no second fold
    fa, ga, _, _ = _transposed_pair()
    item = _item(fa, ga)
    received = pickle.loads(pickle.dumps(item))
    received.set_pad_value()
    assert received.hash == item.hash and received.padding_values() == item.padding_values()


def test_fold_is_the_same_in_every_process() -> None:
    meta = {"image_grid_thw": [[1, 4, 2]]}
    code = f"from sglang_l3.patches.serving.mm_grid_hash import folded_hash;print(folded_hash(2**63 + 5, 'IMAGE', {meta!r}))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONHASHSEED="123"),
    )
    assert int(out.stdout.strip().splitlines()[-1]) == folded_hash(2**63 + 5, "IMAGE", meta)


# --------------------------------------------------------------------------- #
# mm-hashes-guard (decision; the HTTP 400 is checked through the server)
# --------------------------------------------------------------------------- #
L3 = SimpleNamespace(enable_hierarchical_cache=True, hicache_storage_backend="file")
HOST_ONLY = SimpleNamespace(enable_hierarchical_cache=True, hicache_storage_backend=None)
NO_HICACHE = SimpleNamespace(enable_hierarchical_cache=False, hicache_storage_backend=None)


def _tm(args: SimpleNamespace, **live: object) -> SimpleNamespace:
    """A tokenizer manager stand-in: launch args, and `live` as upstream's config_value
    reads them after PUT / DELETE /hicache/storage-backend (none: no config published)."""

    def config_value(name: str) -> object:
        if name not in live:
            raise ValueError("config not published; cannot read a config leaf")
        return live[name]

    return SimpleNamespace(server_args=args, config_value=config_value)


def test_l3_detection() -> None:
    assert l3_attached(_tm(L3)) and not l3_attached(_tm(HOST_ONLY)) and not l3_attached(_tm(NO_HICACHE))
    assert not l3_attached(None)


def test_attached_is_read_from_the_live_config() -> None:
    # a runtime attach / detach changes only the live config (test/e2e/test_runtime_attach.py)
    assert l3_attached(_tm(HOST_ONLY, hicache_storage_backend="file"))
    assert not l3_attached(_tm(L3, hicache_storage_backend=None))
    obj = GenerateReqInput(text="hi", image_data="x", mm_hashes=["0123456789abcdef"])
    with pytest.raises(ValueError, match="mm_hashes is not accepted"):
        check_request(_tm(HOST_ONLY, hicache_storage_backend="file"), obj)
    check_request(_tm(L3, hicache_storage_backend=None), obj)
    tm = _tm(HOST_ONLY, hicache_storage_backend="file")
    tm.enable_lora = True
    tokenized = SimpleNamespace(extra_key="tenant")
    namespace_extra_key(tm, tokenized)
    assert tokenized.extra_key == "tenant|client"
    # HiCache off at launch: no runtime attach is possible (upstream refuses it)
    assert not l3_attached(_tm(NO_HICACHE, hicache_storage_backend="file"))


@pytest.mark.parametrize(
    ("hashes", "expected"),
    [(None, False), ([], False), ([None], False), ([[None], [None]], False), (["ab"], True), ([[None], ["ab"]], True)],
)
def test_supplied(hashes, expected) -> None:
    assert supplied(hashes) is expected


def test_refused_only_with_l3() -> None:
    obj = GenerateReqInput(text="hi", image_data="data:image/png;base64,", mm_hashes=["0123456789abcdef"])
    with pytest.raises(ValueError, match="mm_hashes is not accepted") as e:
        check_request(_tm(L3), obj)
    assert str(e.value) == REFUSAL and "mm-hashes-guard" in REFUSAL
    check_request(_tm(HOST_ONLY), obj)  # pages die with the process: upstream's behaviour
    check_request(_tm(NO_HICACHE), obj)
    check_request(_tm(L3), GenerateReqInput(text="hi", image_data="x"))  # no mm_hashes


@pytest.mark.parametrize("key", ["hash", "pad_value", "pad_values", "identity"])
@pytest.mark.parametrize("field", ["image_data", "video_data", "audio_data"])
def test_preprocessed_media_with_its_own_identity_refused_with_l3(field: str, key: str) -> None:
    # processor_output / precomputed_embedding dicts: upstream takes these keys as the item's hash/pads
    item = {"format": "processor_output", "pixel_values": [[0.0]], "image_grid_thw": [[1, 2, 2]], key: 123}
    for value in (item, [item], [[{"format": "processor_output"}], [item]]):
        obj = SimpleNamespace(mm_hashes=None, **{field: value})
        with pytest.raises(ValueError, match=f"{field} items with a '{key}' key are not accepted"):
            check_request(_tm(L3), obj)
        check_request(_tm(HOST_ONLY), obj)
    # a dict without an identity (content_hash is verified against the media by upstream)
    check_request(
        _tm(L3), SimpleNamespace(mm_hashes=None, **{field: [{"url": "x", "content_hash": "sha256:" + "0" * 64}]})
    )
    assert identity_key_in(["data:image/png;base64,", None, {key: None}]) is None


def _tokenize(obj: GenerateReqInput) -> None:
    """Upstream's TokenizerManager._tokenize_one_request as the server calls it (the
    guard runs before the coroutine is created; a stand-in manager, never awaited)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    coro = TokenizerManager._tokenize_one_request(SimpleNamespace(server_args=L3), obj)
    coro.close()


@pytest.fixture
def without_guard():
    framework.undo("mm-hashes-guard")
    yield
    framework.apply_one(_spec("mm-hashes-guard"))


def test_guard_is_hooked_on_the_tokenizer_manager() -> None:
    with pytest.raises(ValueError, match="mm_hashes is not accepted"):
        _tokenize(GenerateReqInput(text="hi", image_data=["x"], mm_hashes=["0123456789abcdef"]))
    with pytest.raises(ValueError, match="'hash' key"):
        _tokenize(GenerateReqInput(text="hi", image_data=[{"format": "precomputed_embedding", "hash": 5}]))
    _tokenize(GenerateReqInput(text="hi", image_data=["x"]))


def test_negative_control_without_guard_a_forged_hash_gives_two_images_one_key(without_guard) -> None:
    # the request passes, and upstream's caller-hash path (item.set_hash(int(hex, 16)),
    # TokenizerManager._tokenize_one_request) gives two different images the same pad
    # values, i.e. the same page keys from the first image token on
    _tokenize(GenerateReqInput(text="hi", image_data=["x"], mm_hashes=["0123456789abcdef"]))
    a = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.zeros(4, 8))
    b = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.ones(4, 8))
    for item in (a, b):
        item.set("image_grid_thw", torch.tensor([[1, 2, 2]]))
        item.set_hash(int("0123456789abcdef", 16))
        item.set_pad_value()
    assert a.padding_values() == b.padding_values()
    a2 = _item(torch.zeros(4, 8), torch.tensor([[1, 2, 2]]))
    b2 = _item(torch.ones(4, 8), torch.tensor([[1, 2, 2]]))
    assert a2.padding_values() != b2.padding_values()  # the server's own hashes differ


# --------------------------------------------------------------------------- #
# lora-key-namespace: upstream's real Req and storage namespace seed
# --------------------------------------------------------------------------- #
def _req(extra_key: str | None, lora_id: str | None) -> Req:
    return Req("r", "", array("q", [1, 2, 3]), SamplingParams(), extra_key=extra_key, lora_id=lora_id)


def _seed(req: Req) -> str | None:
    return storage_namespace_seed(req.extra_key, req.cache_salt)


def test_an_extra_key_can_name_an_adapters_namespace_upstream() -> None:
    adapter = LoRARef.deterministic_id("sql-adapter", "org/sql-lora")
    # the hole: no adapter, extra_key = the adapter's id -> the adapter's page keys
    assert _seed(_req(None, adapter)) == _seed(_req(adapter, None))
    assert _seed(_req("tenant", adapter)) == _seed(_req("tenant" + adapter, None))


def test_client_keys_cannot_reach_an_adapters_namespace() -> None:
    adapter = LoRARef.deterministic_id("sql-adapter", "org/sql-lora")
    adapter_seeds = {_seed(_req(None, adapter)), _seed(_req(client_key("tenant"), adapter))}
    for forged in (adapter, "tenant" + adapter, "tenant|client" + adapter, client_key("tenant") + adapter):
        assert _seed(_req(client_key(forged), None)) not in adapter_seeds, forged
    assert client_key(None) is None and client_key("") == ""
    assert _seed(_req(client_key("a"), None)) != _seed(_req(client_key("b"), None))


@pytest.mark.parametrize(("lora", "args", "marked"), [(True, L3, True), (False, L3, False), (True, HOST_ONLY, False)])
def test_extra_key_marked_only_with_lora_and_l3(lora, args, marked) -> None:
    tm = _tm(args)
    tm.enable_lora = lora
    tokenized = SimpleNamespace(extra_key="tenant")
    namespace_extra_key(tm, tokenized)
    assert tokenized.extra_key == ("tenant|client" if marked else "tenant")
    none = SimpleNamespace(extra_key=None)
    namespace_extra_key(tm, none)
    assert none.extra_key is None
