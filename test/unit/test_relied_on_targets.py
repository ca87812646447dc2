"""Upstream names our code relies on without hooking them are fingerprinted in the
series (issue 49): each is a target of the patch whose code relies on it, so a bump
that changes one is reported as drift instead of silently changing our behaviour."""

from __future__ import annotations

import pytest
from sglang_l3.patches import framework

# (patch id, target it relies on, the code that relies on it)
RELIED_ON = [
    (
        "streamed-restore",
        "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._prefetch_deadline_expired",
        "a hit waiting for device rows restarts its timer; the deadline test reads it",
    ),
    (
        "tool-pins",
        "sglang.srt.managers.tokenizer_manager:TokenizerManager._dispatch_to_scheduler",
        "sglang_l3.sessions.rpc.send: the pin messages",
    ),
    (
        "tool-call-turns",
        "sglang.srt.managers.tokenizer_manager:TokenizerManager._dispatch_to_scheduler",
        "sglang_l3.sessions.rpc.send: the tool-turn messages",
    ),
    (
        "tool-pins",
        "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.touch_prefix",
        "the touch of the pinned contexts inside _evict",
    ),
    (
        "tool-pins",
        "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore._match_post_processor",
        "the LRU touch of a match (Python tree core)",
    ),
    (
        "tool-pins",
        "sglang.srt.mem_cache.rust_tree_core.adapter:RustUnifiedTreeCore.match_prefix",
        "the LRU touch of a match (Rust tree core)",
    ),
    (
        "session-hints",
        "sglang.srt.managers.communicator:FanOutCommunicator.queueing_call",
        "GET /sglang_l3/sessions's device tokens: why the call is never cancelled",
    ),
]


@pytest.mark.parametrize(("patch_id", "target", "why"), RELIED_ON)
def test_a_relied_on_upstream_name_is_a_fingerprinted_target(patch_id: str, target: str, why: str) -> None:
    spec = next(s for s in framework.load_series() if s.id == patch_id)
    declared = {t.path: t.fingerprint for t in spec.targets}
    assert target in declared, f"{patch_id} relies on {target} ({why}) but does not fingerprint it"
    assert declared[target] == framework.fingerprint_of(framework.resolve(target)), f"{target} drifted"
