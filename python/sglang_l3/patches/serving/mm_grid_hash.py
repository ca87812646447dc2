"""Patch `mm-grid-hash` (why: patches/series.toml): a media item's hash covers
everything that shapes its KV, not only its features (its sibling: `mm_hashes_guard.py`,
no client-supplied identity with L3).

How: AROUND `MultimodalDataItem.set_pad_value`: when upstream derives an item's hash (its
pad value is not set yet), the hash is re-derived from upstream's hash, the modality and
the item's position metadata (`image_grid_thw`, `video_grid_thw`, `second_per_grid_ts`),
and the pad values follow from it (upstream's `MultimodalDataItem.set_hash`). Items
without such metadata, and items whose hash upstream set from elsewhere (the
preprocess-cache artifact key, which already covers the processor's inputs), keep
upstream's hash.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sglang_l3.patches.framework import PatchContext

_ITEM = "sglang.srt.managers.schedule_batch:MultimodalDataItem"

# model_specific_data entries that place an item's tokens (M-RoPE positions, the
# vision tower's rotary grid): two items whose features are equal but these differ
# run differently, so they must not share a hash
POSITION_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
_TAG = b"sglang-l3-mm-item-v1"


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


def apply(ctx: PatchContext) -> None:
    def around(orig: Any, self: Any) -> Any:
        if self.pad_value is not None:  # hash set elsewhere (set_hash / set_identity)
            return orig(self)
        result = orig(self)
        meta = position_metadata(self)
        if meta and self.hash is not None and self.identity is None:
            self.set_hash(folded_hash(self.hash, _modality_name(self), meta))
        return result

    ctx.around(f"{_ITEM}.set_pad_value", around)
