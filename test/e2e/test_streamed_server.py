"""Issue 11 through the real CPU server: a conversation whose context is several
times the host staging buffer is written to L3 and comes back from it.

For each model family (tiny Qwen3-Next, tiny Qwen3.5 multimodal): the family's
no-cache reference server (conftest `reference`, without overlap scheduling), and a
buffer-only L3 server (overlap scheduling on) whose host buffer (`--hicache-ratio`)
is ~1/5 of the last turn's prompt. The conversation grows 600 -> 1200 -> 1800 tokens; after
`/flush_cache` the last turn's prompt must come back from L3 (cached_storage =
the restorable prefix, nothing from device or host) with the same tokens and
logprobs as the no-cache server. Without the streamed patches the same run
restores 0 tokens (the write is dropped and the hit declined; see
test/integration/test_streamed_{write,restore}.py for in-process negative
controls).
"""

from __future__ import annotations

import re

import pytest
from l3_e2e import (
    LARGE_POOL,
    NEW_TOKENS,
    PAGE_SIZE,
    PREFETCH_THRESHOLD,
    STARTUP_TIMEOUT,
    assert_same_output,
    family_params,
    reference_scenario,
    restorable,
)
from sglang_l3.testing.server import Server, ServerConfig, prompt

pytestmark = [pytest.mark.e2e, family_params("qwen3next", "qwen35")]

POOL = LARGE_POOL  # the reference server's pool
HICACHE_RATIO = 0.09  # host KV pool ~ 0.09 x 4096 = 384 tokens (page-rounded)


def _skip_on_accelerator() -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")


@reference_scenario
def _conversation(server) -> list[tuple[list[int], object]]:
    """Three turns: 600, 1200, 1800 tokens (each = history + answer + a new message)."""
    ids = prompt(300, 600)
    turns = []
    for k in range(3):
        g = server.generate(ids, NEW_TOKENS)
        turns.append((ids, g))
        ids = ids + g.output_ids + prompt(400 + k, 600 - NEW_TOKENS)
    return turns


def test_conversation_4x_host_buffer_restores_from_l3(tmp_path, family, reference) -> None:
    _skip_on_accelerator()
    base = {
        "model": family,
        "device": "cpu",
        "max_total_tokens": POOL,
        "page_size": PAGE_SIZE,
        "chunked_prefill_size": 256,
    }
    ref_turns = _conversation(reference)
    reference.stop()  # one server at a time
    last, want = ref_turns[-1]
    l3_cfg = ServerConfig(
        storage_dir=str(tmp_path / "store"),
        prefetch_threshold=PREFETCH_THRESHOLD,
        # the user's default `timeout` stop policy, with a budget a loaded 2-core box cannot miss
        storage_extra_config={"prefetch_timeout_base": 600},
        extra_args=["--hicache-ratio", str(HICACHE_RATIO)],
        **base,
    )
    with Server(l3_cfg, tmp_path / "l3.log", startup_timeout=STARTUP_TIMEOUT) as s:
        m = re.search(r"HiCache kv host pool \((\d+) tokens\)", s.log_text())
        assert m, "host pool size not logged"
        host = int(m.group(1))
        assert len(last) >= 4 * host, f"context {len(last)} must be >= 4x the host buffer {host}"
        turns = _conversation(s)
        for k, ((ids, got), (ref_ids, ref_g)) in enumerate(zip(turns, ref_turns, strict=True)):
            assert ids == ref_ids
            assert_same_output(got, ref_g, "cpu", f"turn {k} (device cache)")
        s.flush_cache()
        got = s.generate(last, NEW_TOKENS)
        assert got.cached_device == 0 and got.cached_host == 0, got.meta
        assert got.cached_storage == restorable(len(last)), (got.meta, len(last))
        assert_same_output(
            got,
            want,
            "cpu",
            f"{len(last)}-token prompt from L3 through a {host}-token buffer",
        )
        assert "bounce cannot fit in an empty host arena" not in s.log_text()
