"""Issue 11 at TP=2 (the user's topology) through real servers on CPU: a context
>= 4x the host staging buffer is written to L3 window by window and, after
`/flush_cache`, comes back from L3 in rounds through that buffer on both ranks
(piece completion and the stream's start decision MIN-reduced across the ranks;
SGLANG_L3_VERIFY=1 all-gathers every restore decision and compares them).

For each model family (tiny Qwen3-Next; tiny Qwen3.5 text-only, whose Gated-DeltaNet
input takes the contiguous split): two TP=2 servers, one after the other (two do
not fit two shared cores): a reference without any cache (and without overlap
scheduling), then a buffer-only L3 server (overlap scheduling on) whose host buffer
(`--hicache-ratio`) is < 1/4 of the prompt. The restored answer must match the
reference's tokens and logprobs (TP=2 vs TP=2: `--load-format dummy` makes TP=1
and TP=2 different models). Without `streamed-restore` the same run restores 0
(the hit is declined: test/integration/test_streamed_restore.py's control).
"""

from __future__ import annotations

import re

import pytest
from l3_e2e import CHUNKED_PREFILL, PAGE_SIZE, PREFETCH_THRESHOLD, STARTUP_TIMEOUT, family_params, restorable
from sglang_l3.testing.server import Server, ServerConfig, prompt
from tp2_e2e import DEVICE, TEST_BOUND, TP, bounded, flush, generate, same_output

# two TP=2 servers per family: minutes on CPU
pytestmark = [pytest.mark.e2e, pytest.mark.slow, family_params("qwen3next", "qwen35-text")]

POOL = 4096
HICACHE_RATIO = 0.09  # host KV pool ~ 0.09 x 4096 = 384 tokens (page-rounded)
NEW = 16
IDS = prompt(500, 1800)
VERIFY_FAIL = "TP ranks made different L3 restore decisions"


def _config(tmp_path, store: bool, model: str) -> ServerConfig:
    return ServerConfig(
        model=model,
        storage_dir=str(tmp_path / "store") if store else None,
        device=DEVICE,
        tp_size=TP,
        max_total_tokens=POOL,
        chunked_prefill_size=CHUNKED_PREFILL,
        page_size=PAGE_SIZE,
        prefetch_threshold=PREFETCH_THRESHOLD if store else None,
        # the user's default `timeout` stop policy, with a budget a loaded 2-core box cannot miss
        storage_extra_config={"prefetch_timeout_base": 600} if store else {},
        extra_args=["--hicache-ratio", str(HICACHE_RATIO)] if store else [],
        env={"SGLANG_L3_VERIFY": "1"},
        overlap_schedule=store,  # the no-cache reference schedules without overlap
    )


def test_tp2_context_4x_host_buffer_restores_from_l3(tmp_path, family, hash_extension_built) -> None:
    from sglang_l3.cpu import accelerator_present

    if DEVICE == "cpu" and accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    if DEVICE != "cpu":
        import torch

        if torch.cuda.device_count() < TP:
            pytest.skip(f"TP={TP} on {DEVICE} needs {TP} GPUs, found {torch.cuda.device_count()}")
    servers: list[Server] = []
    with Server(_config(tmp_path, False, family), tmp_path / "plain.log", startup_timeout=STARTUP_TIMEOUT) as ref:
        servers.append(ref)
        with bounded(TEST_BOUND, "reference", lambda: servers):
            want = generate(ref, IDS, NEW, "reference")
        servers.clear()
    assert len(set(want.output_ids)) > 1, "degenerate dummy weights"
    with Server(_config(tmp_path, True, family), tmp_path / "l3.log", startup_timeout=STARTUP_TIMEOUT) as s:
        servers.append(s)
        m = re.search(r"HiCache kv host pool \((\d+) tokens\)", s.log_text())
        assert m, "host pool size not logged"
        host = int(m.group(1))
        assert len(IDS) >= 4 * host, f"context {len(IDS)} must be >= 4x the host buffer {host}"
        with bounded(TEST_BOUND, "streamed restore at TP=2", lambda: servers):
            cold = generate(s, IDS, NEW, "cold")
            assert cold.cached_tokens == 0, cold.meta
            same_output(cold, want, "cold vs no-cache TP=2")
            flush(s, "flush after the cold run")
            warm = generate(s, IDS, NEW, "after flush")
        assert warm.cached_device == 0 and warm.cached_host == 0, warm.meta
        assert warm.cached_storage == restorable(len(IDS)), (warm.meta, len(IDS))
        same_output(warm, want, f"{len(IDS)}-token prompt from L3 through a {host}-token buffer at TP=2")
        log = s.log_text()
        assert VERIFY_FAIL not in log, s.log_tail(80)
        assert "bounce cannot fit in an empty host arena" not in log
