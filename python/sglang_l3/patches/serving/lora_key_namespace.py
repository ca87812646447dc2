"""Patch `lora-key-namespace` (why: patches/series.toml): a caller's `extra_key` can
never name a LoRA adapter's page-key namespace while the pages go to L3.

How: AFTER `TokenizerManager._create_tokenized_object`, while L3 is attached
(`l3_attached`: at launch or by `PUT /hicache/storage-backend`) on a server with
LoRA enabled, a caller's `extra_key` gets CLIENT_KEY_MARK appended before it reaches
the scheduler (where upstream appends the adapter id). The mark ends in a character
that is not hex, adapter ids are 32 hex characters: a request without an adapter can
no longer name an adapter's namespace.
"""

from __future__ import annotations

from typing import Any

from sglang_l3.live_config import l3_attached
from sglang_l3.patches.framework import PatchContext

_TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"
CLIENT_KEY_MARK = "|client"  # last character not in [0-9a-f]


def client_key(extra_key: Any) -> Any:
    """A caller's extra_key in the namespace no adapter id can end: None/"" stay."""
    return f"{extra_key}{CLIENT_KEY_MARK}" if isinstance(extra_key, str) and extra_key else extra_key


def namespace_extra_key(tokenizer_manager: Any, tokenized: Any) -> None:
    """Mark a tokenized request's caller extra_key when LoRA and L3 are both on."""
    if (
        getattr(tokenizer_manager, "enable_lora", False)
        and l3_attached(tokenizer_manager)
        and getattr(tokenized, "extra_key", None)
    ):
        tokenized.extra_key = client_key(tokenized.extra_key)


def apply(ctx: PatchContext) -> None:
    def after(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
        namespace_extra_key(self, result)

    ctx.after(f"{_TM}._create_tokenized_object", after)
