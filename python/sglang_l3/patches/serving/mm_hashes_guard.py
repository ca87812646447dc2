"""Patch `mm-hashes-guard` (why: patches/series.toml): a request's media identity is
computed by the server, never taken verbatim from the client, while L3 is attached (its
siblings: `mm_grid_hash.py`, what else goes into a media item's hash; the LoRA
counterpart: `lora_key_namespace.py`).

How: BEFORE `TokenizerManager._tokenize_one_request` (so before any image is fetched or
decoded), while a HiCache storage backend (L3) is attached (at launch or by
`PUT /hicache/storage-backend`: `l3_attached` reads the live config), a request that
carries `mm_hashes` is a ValueError, which the HTTP routes (/generate,
/v1/chat/completions, /v1/completions) answer with 400 and the message. So is a
preprocessed media item (a dict in image_data / video_data / audio_data) that carries its
own hash / pad_value(s) / identity: upstream takes those as the item's key too. Without L3
the request is left to upstream (its pages live only as long as the process).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_l3.live_config import l3_attached
from sglang_l3.patches.framework import PatchContext

_TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"


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


def apply(ctx: PatchContext) -> None:
    def before(self: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
        check_request(self, obj)

    ctx.before(f"{_TM}._tokenize_one_request", before)
