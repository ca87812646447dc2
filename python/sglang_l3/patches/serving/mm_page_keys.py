"""Patches `mm-hashes-guard` and `mm-grid-hash` (why: patches/series.toml): what a
request's media contribute to its page keys is computed by the server from
everything that shapes the KV, never taken verbatim from the client (the LoRA
counterpart: `lora_key_namespace.py`).

How:
- mm-hashes-guard: BEFORE `TokenizerManager._tokenize_one_request` (so before any
  image is fetched or decoded), while a HiCache storage backend (L3) is attached (at
  launch or by `PUT /hicache/storage-backend`: `l3_attached` reads the live config), a
  request that carries `mm_hashes` is a ValueError, which the HTTP routes (/generate,
  /v1/chat/completions, /v1/completions) answer with 400 and the message. So is a
  preprocessed media item (a dict in image_data / video_data / audio_data) that
  carries its own hash / pad_value(s) / identity: upstream takes those as the
  item's key too. Without L3 the request is left to upstream (its pages live only
  as long as the process).
- mm-grid-hash: AROUND `MultimodalDataItem.set_pad_value`: when upstream derives an
  item's hash (its pad value is not set yet), the hash is re-derived from upstream's
  hash, the modality and the item's position metadata (`image_grid_thw`,
  `video_grid_thw`, `second_per_grid_ts`), and the pad values follow from it
  (upstream's `MultimodalDataItem.set_hash`). Items without such metadata, and
  items whose hash upstream set from elsewhere (the preprocess-cache artifact key,
  which already covers the processor's inputs), keep upstream's hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from sglang_l3.live_config import l3_attached
from sglang_l3.patches.framework import PatchContext

_TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"
_ITEM = "sglang.srt.managers.schedule_batch:MultimodalDataItem"

# model_specific_data entries that place an item's tokens (M-RoPE positions, the
# vision tower's rotary grid): two items whose features are equal but these differ
# run differently, so they must not share a hash
POSITION_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
_TAG = b"sglang-l3-mm-item-v1"


# --------------------------------------------------------------------------- #
# mm-hashes-guard
# --------------------------------------------------------------------------- #
def supplied(values: Any) -> bool:
    """True when a (possibly nested) list of per-item hashes holds any value."""
    if values is None:
        return False
    if isinstance(values, (list, tuple)):
        return any(supplied(v) for v in values)
    return True


REFUSAL = (
    "mm_hashes is not accepted by this server: it keeps KV pages in a HiCache L3 store "
    "(--hicache-storage-backend), where a caller-supplied image hash would become the key "
    "of the image's pages, so one request could make a different image share (and "
    "overwrite the meaning of) pages that outlive a restart. Send the request without "
    "mm_hashes; the server hashes each image itself (sglang-l3 patch mm-hashes-guard)."
)


# keys of a preprocessed media item (image_data / video_data / audio_data given as a
# dict, format processor_output or precomputed_embedding) that upstream takes as
# the item's hash or pad values (`BaseMultimodalProcessor.collect_mm_items_from_processor_output`,
# the precomputed-embedding branch of `_process_and_collect_mm_items`); the same list
# upstream's Kimi processor refuses (`kimi_common._CALLER_IDENTITY_KEYS`)
IDENTITY_KEYS = ("hash", "pad_value", "pad_values", "identity")
MEDIA_FIELDS = ("image_data", "video_data", "audio_data")


def identity_key_in(values: Any) -> str | None:
    """The first caller identity key in a (possibly nested) list of media items."""
    if isinstance(values, Mapping):
        return next((k for k in IDENTITY_KEYS if values.get(k) is not None), None)
    if isinstance(values, (list, tuple)):
        return next((k for k in map(identity_key_in, values) if k is not None), None)
    return None


def media_refusal(field: str, key: str) -> str:
    return (
        f"{field} items with a {key!r} key are not accepted by this server: it keeps KV pages "
        "in a HiCache L3 store (--hicache-storage-backend), where a caller-supplied media "
        "identity would become the key of the item's pages (the same hole as mm_hashes). "
        f"Send the item without {key!r}; the server hashes the features itself "
        "(sglang-l3 patch mm-hashes-guard)."
    )


def check_request(tokenizer_manager: Any, obj: Any) -> None:
    """Refuse a caller-supplied media identity while L3 is attached (`l3_attached`)."""
    if not l3_attached(tokenizer_manager):
        return
    if supplied(getattr(obj, "mm_hashes", None)):
        raise ValueError(REFUSAL)
    for field in MEDIA_FIELDS:
        key = identity_key_in(getattr(obj, field, None))
        if key is not None:
            raise ValueError(media_refusal(field, key))


# --------------------------------------------------------------------------- #
# mm-grid-hash
# --------------------------------------------------------------------------- #
def _plain(value: Any) -> Any:
    """Tensors / arrays / tuples -> JSON-able nested lists (exact ints and floats)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def position_metadata(item: Any) -> dict[str, Any]:
    data = getattr(item, "model_specific_data", None) or {}
    return {k: _plain(data[k]) for k in POSITION_KEYS if data.get(k) is not None}


def folded_hash(item_hash: int, modality: str, meta: dict[str, Any]) -> int:
    """64-bit hash of (upstream's item hash, modality, position metadata)."""
    h = hashlib.sha256(_TAG)
    h.update(int(item_hash).to_bytes(8, "big", signed=False))
    h.update(modality.encode())
    h.update(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    return int.from_bytes(h.digest()[:8], "big")


def _modality_name(item: Any) -> str:
    m = getattr(item, "modality", None)
    return str(getattr(m, "name", m))


# --------------------------------------------------------------------------- #
def apply(ctx: PatchContext) -> None:
    {
        "mm-hashes-guard": _apply_guard,
        "mm-grid-hash": _apply_grid_hash,
    }[ctx.id](ctx)


def _apply_guard(ctx: PatchContext) -> None:
    def before(self: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
        check_request(self, obj)

    ctx.before(f"{_TM}._tokenize_one_request", before)


def _apply_grid_hash(ctx: PatchContext) -> None:
    def around(orig: Any, self: Any) -> Any:
        if self.pad_value is not None:  # hash set elsewhere (set_hash / set_identity)
            return orig(self)
        result = orig(self)
        meta = position_metadata(self)
        if meta and self.hash is not None and self.identity is None:
            self.set_hash(folded_hash(self.hash, _modality_name(self), meta))
        return result

    ctx.around(f"{_ITEM}.set_pad_value", around)
