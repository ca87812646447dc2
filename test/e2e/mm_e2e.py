"""Shared pieces of the tiny-Qwen3.5 multimodal e2e tests (test_images_server.py,
test_openai_client.py): PNG images made in the test, prompts with image slots, and
one set of servers for the whole test session.

`Qwen35Servers` starts lazily, at most once per pytest session:
- `l3`: tiny-qwen35 with the README's L3 flags (buffer-only HiCache, `file` backend,
  its own store_dir) and a small host staging buffer (`--hicache-ratio`, as in
  test_streamed_server.py), so a context of ~1000+ tokens is restored through the
  streamed path while shorter ones are not; `restart()` replaces it with a fresh
  process over the same store;
- `reference`: the same model without HiCache and without a radix cache: every
  answer is computed from scratch;
- `unguarded`: like `l3` (own store) with the page-key patches disabled
  (SGLANG_L3_DISABLE), for negative controls only.
Every server loads the tokenizer and processor (images, text, chat) and reports
cached tokens in the OpenAI usage (`--enable-cache-report`).
"""

from __future__ import annotations

import base64
import functools
import io
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from l3_e2e import PAGE_SIZE, PREFETCH_THRESHOLD, STARTUP_TIMEOUT
from sglang_l3.testing.server import Generation, Server, ServerConfig, model_dir, warm_hicache_hash_extension

MODEL = "tiny-qwen35"
POOL = 4096
HICACHE_RATIO = 0.09  # host KV pool ~ 0.09 x 4096 = 384 tokens (page-rounded)
CHUNKED_PREFILL = 256
NEW_TOKENS = 8
# what the negative-control server runs without
UNGUARDED = "mm-hashes-guard,mm-grid-hash,input-ids-check"

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_SLOT = VISION_START + IMAGE_PAD + VISION_END


# --------------------------------------------------------------------------- #
# images and prompts
# --------------------------------------------------------------------------- #
def png(seed: int, width: int = 64, height: int = 64) -> bytes:
    """A deterministic noise PNG (every pixel from a seeded RNG)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return _encode(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def transposed_pair(seed: int) -> tuple[bytes, bytes]:
    """Two different images Qwen's processor turns into identical pixel_values:
    blocks P over Q (64x32 px, grid 1x4x2) and P beside Q (32x64, grid 1x2x4). The
    processor flattens 2x2-patch blocks (32x32 px with patch 16) row by row."""
    import numpy as np

    rng = np.random.default_rng(seed)
    p, q = (rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(2))
    return _encode(np.concatenate([p, q], axis=0)), _encode(np.concatenate([p, q], axis=1))


def _encode(pixels: Any) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


_WORDS: list[str] = []


def words(seed: int, n: int) -> str:
    """n seeded words from this repository's LICENSE (the tiny tokenizer's corpus)."""
    if not _WORDS:
        lic = Path(__file__).resolve().parents[2] / "LICENSE"
        _WORDS.extend(sorted({w for w in lic.read_text().split() if w.isalpha()}))
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir(MODEL)))


def image_start(text: str) -> int:
    """Token position of the first image's first token in the server's prompt (the
    processor tokenizes the text; the tokens before the image are not expanded)."""
    ids = tokenizer()(text)["input_ids"]
    return ids.index(tokenizer().convert_tokens_to_ids(VISION_START)) + 1


def chat_text(user: str) -> str:
    """One user turn and the generation prompt, rendered by the model's own chat
    template (the one the real Qwen3.5 ships: it opens `<think>`)."""
    msgs = [{"role": "user", "content": user}]
    return tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


# --------------------------------------------------------------------------- #
# requests
# --------------------------------------------------------------------------- #
def generate(
    server: Server,
    text: str,
    images: list[bytes] = (),  # type: ignore[assignment]
    max_new_tokens: int = NEW_TOKENS,
    extra: dict[str, Any] | None = None,
) -> Generation:
    """Greedy /generate with text and PNG images (data URLs); tokens, logprobs and
    where the server says the cached prefix came from."""
    status, out = post_generate(server, text, images, max_new_tokens, extra)
    if status != 200:
        raise AssertionError(f"/generate answered {status}: {out}")
    meta = out["meta_info"]
    return Generation.from_response(out, int(meta.get("prompt_tokens", 0)), 0.0, 0.0)


def post_generate(
    server: Server,
    text: str,
    images: list[bytes] = (),  # type: ignore[assignment]
    max_new_tokens: int = NEW_TOKENS,
    extra: dict[str, Any] | None = None,
) -> tuple[int, Any]:
    body: dict[str, Any] = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        "return_logprob": True,
    }
    if images:
        body["image_data"] = [data_url(i) for i in images]
    body.update(extra or {})
    return server.post("/generate", body, timeout=900)


def wait_stored(server: Server, session_id: str, tokens: int, timeout: float = 900.0) -> None:
    """Wait until the L3 store holds the first tokens // 64 pages of the session's
    context (its key chain, GET /sglang_l3/sessions). Not needed before a /flush_cache
    (upstream flushes only once the L3 pipeline is idle: nothing queued, in flight or
    unacked; test_flush_restore_server.py); it is how these tests learn that the pages
    are stored at all."""
    import json

    pages = tokens // PAGE_SIZE
    deadline = time.monotonic() + timeout
    row: Any = None
    while time.monotonic() < deadline:
        rows = json.loads(server.get_text("/sglang_l3/sessions")).get("sessions", [])
        row = next((r for r in rows if r.get("id") == session_id), None)
        if row is not None and row["restorable_pages"] >= pages:
            return
        time.sleep(0.5)
    raise AssertionError(f"L3 never held {pages} pages of session {session_id}: {row}")


def generate_stored(server: Server, text: str, images: list[bytes], session_id: str) -> Generation:
    """generate() as a session's turn, returning once its prompt's pages are in L3."""
    got = generate(server, text, images, extra={"session_id": session_id})
    wait_stored(server, session_id, got.prompt_tokens)
    return got


def assert_same(got: Generation, want: Generation, what: str) -> None:
    """Tokens and logprobs identical to the no-cache server (CPU torch kernels)."""
    assert got.output_ids == want.output_ids, f"{what}: tokens differ: {got.output_ids} vs {want.output_ids}"
    assert got.logprobs == want.logprobs, f"{what}: logprobs differ: {got.logprobs} vs {want.logprobs}"


# --------------------------------------------------------------------------- #
# servers
# --------------------------------------------------------------------------- #
def l3_config(store: Path, **kw: Any) -> ServerConfig:
    return ServerConfig(
        model=MODEL,
        skip_tokenizer_init=False,
        storage_dir=str(store),
        max_total_tokens=POOL,
        page_size=PAGE_SIZE,
        chunked_prefill_size=CHUNKED_PREFILL,
        prefetch_threshold=PREFETCH_THRESHOLD,
        # the user's default `timeout` stop policy, with a budget a loaded 2-core box cannot miss
        storage_extra_config={"prefetch_timeout_base": 600},
        extra_args=["--hicache-ratio", str(HICACHE_RATIO), "--enable-cache-report"],
        **kw,
    )


def reference_config() -> ServerConfig:
    return ServerConfig(
        model=MODEL,
        skip_tokenizer_init=False,
        storage_dir=None,
        max_total_tokens=POOL,
        page_size=PAGE_SIZE,
        chunked_prefill_size=CHUNKED_PREFILL,
        extra_args=["--disable-radix-cache", "--enable-cache-report"],
        overlap_schedule=False,  # plain sequential scheduling, as the other no-cache references
    )


@dataclass
class Qwen35Servers:
    root: Path
    servers: dict[str, Server] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    restarts: int = 0

    @property
    def store(self) -> Path:
        return self.root / "store"

    def _get(self, name: str, config: ServerConfig) -> Server:
        if name in self.servers and self.servers[name].alive():
            return self.servers[name]
        if name in self.failed:  # not retried by every later test
            pytest.fail(f"{name} server failed to start earlier: {self.failed[name][:2000]}")
        warm_hicache_hash_extension()
        log = self.root / f"{name}-{len(self.servers)}-{time.monotonic_ns()}.log"
        try:
            self.servers[name] = Server(config, log, startup_timeout=STARTUP_TIMEOUT).start()
        except Exception as e:
            self.failed[name] = str(e)
            raise
        return self.servers[name]

    @property
    def l3(self) -> Server:
        return self._get("l3", l3_config(self.store))

    @property
    def reference(self) -> Server:
        return self._get("reference", reference_config())

    @property
    def unguarded(self) -> Server:
        return self._get("unguarded", l3_config(self.root / "store-unguarded", env={"SGLANG_L3_DISABLE": UNGUARDED}))

    def restart(self) -> Server:
        """Stop the L3 server; a new process over the same store."""
        s = self.servers.pop("l3", None)
        if s is not None:
            s.stop()
        self.restarts += 1
        return self.l3

    def stop(self, name: str | None = None) -> None:
        for n in [name] if name else list(self.servers):
            s = self.servers.pop(n, None)
            if s is not None:
                s.stop()


_SHARED: dict[str, Qwen35Servers] = {}


SHARING = ("test_images_server.py", "test_openai_client.py")  # the modules that share them


def release_if_done(request: pytest.FixtureRequest) -> None:
    """At a sharing module's end: stop the shared servers when no test collected after
    this module's last one uses them (they hold ~5 GB that later servers' start-up
    check for HiCache's 10 GiB host reserve needs); a later user starts them again."""
    items = request.session.items
    mine = [i for i, it in enumerate(items) if it.path == request.path]
    if not mine or any(it.path.name in SHARING for it in items[mine[-1] + 1 :]):
        return
    s = _SHARED.get("s")
    if s is not None:
        s.stop()


def shared_servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Qwen35Servers:
    """The session's one Qwen35Servers (stopped after the last module that shares them,
    or when the session ends)."""
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    if "s" not in _SHARED:
        _SHARED["s"] = Qwen35Servers(tmp_path_factory.mktemp("qwen35-mm"))
        request.config.add_cleanup(lambda: _SHARED.pop("s").stop())
    return _SHARED["s"]
