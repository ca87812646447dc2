"""Issue 33 item 1: a /flush_cache right after an answer (no wait for the L3 writes)
loses nothing; what the next turn restores is all the turn left restorable.

The soak's short restore (384 of 448, benchmark/soak_server.py) was a turn of 445
prompt tokens and 4 new ones: 448 tokens computed, the last 3 by decode. Upstream
(`--mamba-radix-cache-strategy extra_buffer`) keeps a Mamba state during prefill at the
prompt's last 64-token boundary (384) and during decode only where the sequence length
is a multiple of `mamba_track_interval` (256, lcm with the 64-token grid); a finished
request is inserted into the tree only up to its last kept state
(`mamba.py` `prepare_for_caching_req`: `mamba_last_track_seqlen`). So tokens 384-448
never enter the tree, nothing writes them to L3, and the next turn can restore 384:
448 was never restorable (the soak's count was wrong, not the store). Here, on a real
CPU server:

- turn A (445 + 4) then at once /flush_cache, which upstream runs only when the L3
  pipeline is idle (no write queued, in flight or unacked; the server logs that
  state at each flush, read below): the store holds its KV pages and Mamba states up
  to 384 and no further, nothing was dropped (`l3_write_dropped`), and the next turn
  restores exactly 384;
- turn B (250 + 8: decode passes 256) the same way: decode kept a state at 256, the
  store holds everything up to 256, and the next turn restores 256, past the
  prompt's own boundary (192).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from l3_e2e import CHUNKED_PREFILL, PAGE_SIZE, PREFETCH_THRESHOLD, STARTUP_TIMEOUT
from sglang_l3.storage.format import parse_page_name
from sglang_l3.testing.server import Server, ServerConfig, prompt

pytestmark = pytest.mark.e2e

TRACK_INTERVAL = 256  # upstream's --mamba-track-interval default: decode stores a state there
_DROPPED = re.compile(r'^sglang_l3_l3_write_dropped_total\{reason="([^"]*)"\}\s+([0-9.eE+-]+)$', re.M)
_FLUSH_LOG = re.compile(r"sglang-l3: /flush_cache (done|refused); L3 pipeline before it: (.*)")


def checkpoint_after_turn(prompt_len: int, computed: int) -> int:
    """The deepest Mamba state a turn leaves (prefix on the 64-token grid): the prompt's
    last 64-token boundary (prefill), or a multiple of TRACK_INTERVAL decode passed."""
    decode = computed // TRACK_INTERVAL * TRACK_INTERVAL
    return max(prompt_len // PAGE_SIZE * PAGE_SIZE, decode if decode > prompt_len else 0)


def stored(store: Path, ids: list[int]) -> tuple[int, list[int]]:
    """(KV pages of `ids`' full pages in the store, in order from the first; the page
    counts at which a Mamba state is stored)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    have: dict[str, set[str]] = {}
    for p in (store / "pages").iterdir():
        n = parse_page_name(p.name)
        if n is not None:
            have.setdefault(n.pool, set()).add(n.key)
    keys = get_hash_str(ids[: len(ids) // PAGE_SIZE * PAGE_SIZE], None, page_size=PAGE_SIZE)
    kv = next((i for i, k in enumerate(keys) if k not in have.get("kv", set())), len(keys))
    return kv, [i + 1 for i, k in enumerate(keys) if k in have.get("mamba", set())]


def dropped(s: Server) -> dict[str, float]:
    return {r: float(v) for r, v in _DROPPED.findall(s.get_text("/metrics"))}


# (prompt tokens, new tokens, the turn's deepest kept state = what the next turn restores)
CASES = ((445, 4, 384), (250, 8, 256))  # decode ends off a checkpoint; decode passes 256


def test_a_flush_right_after_an_answer_loses_nothing(tmp_path, hash_extension_built) -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("the CPU server variant needs a machine without an accelerator")
    store = tmp_path / "store"
    cfg = ServerConfig(
        storage_dir=str(store),
        chunked_prefill_size=CHUNKED_PREFILL,
        prefetch_threshold=PREFETCH_THRESHOLD,
        page_size=PAGE_SIZE,
        extra_args=["--enable-metrics"],
    )
    with Server(cfg, tmp_path / "server.log", startup_timeout=STARTUP_TIMEOUT) as s:
        for prompt_len, new_tokens, want in CASES:
            what = f"{prompt_len} + {new_tokens}"
            ids = prompt(7 + prompt_len, prompt_len)
            a = s.generate(ids, new_tokens)
            computed = prompt_len + len(a.output_ids) - 1  # the last token was sampled, never computed
            assert len(a.output_ids) == new_tokens and a.cached_tokens == 0, (what, a.meta)
            refused = s.flush_cache()  # at once: no wait for the L3 writes
            flushes = _FLUSH_LOG.findall(s.log_text())
            print(f"[flush] {what}: refused {len(refused)} time(s) first; server: {flushes[-1:]}; dropped {dropped(s)}")
            assert flushes and flushes[-1][0] == "done" and "idle=True" in flushes[-1][1], (what, flushes)
            assert "l3_write_dropped=0" in flushes[-1][1] and not dropped(s), (what, flushes, dropped(s))

            history = ids + a.output_ids
            kv_pages, states = stored(store, history[:computed])
            assert checkpoint_after_turn(prompt_len, computed) == want, what
            assert max(states) * PAGE_SIZE == want, (what, states)  # the deepest state the turn kept ...
            assert kv_pages * PAGE_SIZE == want, (what, kv_pages, computed)  # ... and the KV up to it, no further

            b = s.generate(history + prompt(99, 48), new_tokens)
            assert b.cached_device == 0 and b.cached_storage == want, (what, b.meta)
