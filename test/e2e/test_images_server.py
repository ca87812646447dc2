"""Images with L3 through the real CPU server (issue 23, items 4-5).

The tiny multimodal Qwen3.5 (`tiny-qwen35`, `Qwen3_5ForConditionalGeneration`) is
served with the README's L3 flags (buffer-only HiCache, `file` store in its own
store_dir, a small host staging buffer); PNG images are made here and sent as data
URLs with /generate. Every answer (tokens and logprobs) is compared with a server
without any cache (no HiCache, no radix cache). Restored counts are the server's
own `cached_tokens_details`; after `/flush_cache` or a restart every cached token
came from L3.

An image stands in the prompt as pad values derived from the image's hash, so the
L3 page keys (a SHA-256 chain over the tokens) diverge at the first image token:
two images must never share a page past it. Holes closed by our patches, each
with a negative control on a server that runs without them (`unguarded`):
- a client-supplied `mm_hashes` would become the image's key (mm-hashes-guard: 400);
- two different images with equal pixel_values but different grids hashed alike
  (mm-grid-hash);
- ids outside the vocabulary in a multimodal request's own input_ids (input-ids-check).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from l3_e2e import restorable
from mm_e2e import (
    IMAGE_SLOT,
    Qwen35Servers,
    assert_same,
    chat_text,
    data_url,
    generate,
    generate_stored,
    image_start,
    png,
    post_generate,
    release_if_done,
    shared_servers,
    tokenizer,
    transposed_pair,
    wait_stored,
    words,
)

pytestmark = pytest.mark.e2e

FORGED = "0123456789abcdef"  # any hex string: upstream takes it as the item hash


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory) -> Iterator[Qwen35Servers]:
    yield shared_servers(request, tmp_path_factory)
    release_if_done(request)


def _fresh_l3(s: Qwen35Servers):
    """The L3 server with an empty device/host cache (L3 keeps what it has)."""
    server = s.l3
    server.flush_cache()
    return server


def _assert_no_page_past_image(g, text: str, what: str) -> None:
    start = image_start(text)
    assert g.cached_tokens <= start, f"{what}: {g.cached_tokens} cached tokens reach past the image at {start}"


# --------------------------------------------------------------------------- #
# item 4: images with L3
# --------------------------------------------------------------------------- #
def test_different_images_share_no_page_after_the_first_image_token(servers: Qwen35Servers) -> None:
    text = chat_text(words(11, 220) + IMAGE_SLOT + words(12, 160))
    a, b = png(101, 128, 128), png(102, 128, 128)
    l3 = _fresh_l3(servers)
    first_a = generate_stored(l3, text, [a], "img-a")
    l3.flush_cache()
    got_b = generate(l3, text, [b])
    _assert_no_page_past_image(got_b, text, "image B after image A")
    # the text before the image is shared, from L3 (the device was flushed), up to
    # the deepest Mamba checkpoint A's request stored before the image
    assert got_b.cached_storage > 0 and got_b.cached_device == 0, got_b.source
    l3.flush_cache()
    again_a = generate(l3, text, [a])
    assert again_a.cached_storage == restorable(again_a.prompt_tokens), again_a.source  # B did not overwrite A's pages
    ref = servers.reference
    want_a, want_b = generate(ref, text, [a]), generate(ref, text, [b])
    assert want_a.logprobs != want_b.logprobs  # the premise: the two images answer differently
    assert_same(first_a, want_a, "image A computed")
    assert_same(got_b, want_b, "image B")
    assert_same(again_a, want_a, "image A from L3")


def test_same_pixels_different_grid_share_no_page(servers: Qwen35Servers) -> None:
    """64x32 [P over Q] and 32x64 [P beside Q] give Qwen's processor identical
    pixel_values; their grids differ (patch mm-grid-hash)."""
    text = chat_text(words(21, 200) + IMAGE_SLOT + words(22, 180))
    x, y = transposed_pair(23)
    l3 = _fresh_l3(servers)
    got_x = generate(l3, text, [x])
    got_y = generate(l3, text, [y])  # device cache holds X's context
    _assert_no_page_past_image(got_y, text, "Y after X (device)")
    l3.flush_cache()
    y_l3 = generate(l3, text, [y])
    assert y_l3.cached_storage == restorable(y_l3.prompt_tokens), y_l3.source  # Y's own pages
    ref = servers.reference
    want_x, want_y = generate(ref, text, [x]), generate(ref, text, [y])
    assert want_x.logprobs != want_y.logprobs  # the premise: the grid changes the answer
    assert_same(got_x, want_x, "X")
    assert_same(got_y, want_y, "Y after X")
    assert_same(y_l3, want_y, "Y from L3")


def _image_conversation(servers: Qwen35Servers, flush_each_turn: bool) -> None:
    """Three turns of a conversation whose image (64 tokens at ~300) stays near the
    front; the last prompt is ~1500 tokens, the host staging buffer ~384."""
    image = png(31, 256, 256)  # grid 1x16x16 -> 64 tokens
    text = chat_text(words(32, 300) + IMAGE_SLOT + words(33, 300))
    ref, l3 = servers.reference, _fresh_l3(servers)
    for k in range(3):  # the conversation grows
        if k:
            text = text + words(40 + k, 20) + "<|im_end|>\n" + chat_text(words(50 + k, 300))
            if flush_each_turn:  # the history, image included, streams back from L3
                l3.flush_cache()
        got = generate_stored(l3, text, [image], "streamed" if flush_each_turn else "streamed-device")
        if k and flush_each_turn:
            assert got.cached_device == 0 and got.cached_storage > image_start(text) + 64, got.source
        assert_same(got, generate(ref, text, [image]), f"turn {k + 1}")
    assert got.prompt_tokens > 3 * 384, got.prompt_tokens
    l3.flush_cache()
    back = generate(l3, text, [image])
    assert back.cached_storage == restorable(back.prompt_tokens) and back.cached_device == 0, back.source
    assert_same(back, generate(ref, text, [image]), "streamed restore with an image")


def test_image_in_a_context_larger_than_the_host_buffer(servers: Qwen35Servers) -> None:
    """Streamed restore: before each turn the device cache is flushed, so the history
    with its image comes back from L3 through a buffer smaller than the context."""
    _image_conversation(servers, flush_each_turn=True)


def test_image_history_from_the_device_cache(servers: Qwen35Servers) -> None:
    """The history, image included, comes from the device cache: the new part's
    prefill starts at the cached prefix's end, not where the no-cache server's chunks
    start (exact only with patch cpu-attention-invariant: ~2e-4 in logprobs without)."""
    _image_conversation(servers, flush_each_turn=False)


def test_conversation_adds_an_image_at_turn_3(servers: Qwen35Servers) -> None:
    """Four turns; turn 3 adds an image. Before each turn the device cache is
    flushed: the history comes back from L3, image included from turn 4 on."""
    image = png(61, 128, 128)
    users = [words(62, 120), words(63, 80), words(64, 60) + IMAGE_SLOT + words(65, 120), words(66, 60)]
    replies = [words(70 + k, 15) for k in range(4)]
    ref, l3 = servers.reference, _fresh_l3(servers)
    tok = tokenizer()
    history, prev_ids, prev_tokens = "", None, 0
    for k, user in enumerate(users):
        text = history + chat_text(user)
        images = [image] if k >= 2 else []
        ids = tok(text)["input_ids"]  # the image is one placeholder here, expanded by the server
        l3.flush_cache()
        got = generate_stored(l3, text, images, "turn3")
        assert_same(got, generate(ref, text, images), f"turn {k + 1}")
        if prev_ids is not None:
            assert ids[: len(prev_ids)] == prev_ids, f"turn {k + 1}: the history re-tokenizes differently"
            assert got.cached_device == 0 and got.cached_storage >= restorable(prev_tokens), (k + 1, got.source)
        if k == 3:  # the image (16 tokens) of turn 3 came back with the history
            assert got.cached_storage >= image_start(text) + 16, got.source
        history = text + replies[k] + "<|im_end|>\n"
        prev_ids, prev_tokens = ids, got.prompt_tokens


# --------------------------------------------------------------------------- #
# item 5: client-supplied fields that feed the page keys
# --------------------------------------------------------------------------- #
def test_mm_hashes_refused_with_l3(servers: Qwen35Servers) -> None:
    text = chat_text(words(81, 200) + IMAGE_SLOT + words(82, 160))
    a, b = png(83, 128, 128), png(84, 128, 128)
    l3 = _fresh_l3(servers)
    generate(l3, text, [a])  # A's pages, keyed by the server's own hash
    for img in (a, b):
        status, body = post_generate(l3, text, [img], extra={"mm_hashes": [FORGED]})
        assert status == 400, (status, body)
        assert "mm_hashes is not accepted" in str(body) and "mm-hashes-guard" in str(body), body
    # the refused requests wrote nothing; B without mm_hashes shares no page past the image
    l3.flush_cache()
    got_b = generate(l3, text, [b])
    _assert_no_page_past_image(got_b, text, "B after refused forgeries")
    assert_same(got_b, generate(servers.reference, text, [b]), "B")


def test_out_of_vocabulary_ids_with_an_image_refused(servers: Qwen35Servers) -> None:
    tok = tokenizer()
    ids = tok(chat_text(words(91, 100) + IMAGE_SLOT + words(92, 50)))["input_ids"]
    l3 = servers.l3
    for bad in (5000, 2**40):
        forged = ids[:10] + [bad] + ids[10:]
        status, body = l3.post(
            "/generate",
            {"input_ids": forged, "image_data": [data_url(png(93, 64, 64))], "sampling_params": {"max_new_tokens": 1}},
        )
        assert status == 400 and "out of range" in str(body), (bad, status, body)


@pytest.mark.slow
def test_after_restart_same_image_restores_and_forgery_stays_refused(servers: Qwen35Servers) -> None:
    text = chat_text(words(101, 240) + IMAGE_SLOT + words(102, 140))
    a, b = png(103, 128, 128), png(104, 128, 128)
    l3 = _fresh_l3(servers)
    generate_stored(l3, text, [a], "restart-a")
    l3.flush_cache()
    flushed = generate(l3, text, [a])
    assert flushed.cached_storage == restorable(flushed.prompt_tokens) and flushed.cached_device == 0, flushed.source
    l3 = servers.restart()
    restarted = generate(l3, text, [a])
    assert restarted.cached_storage == restorable(restarted.prompt_tokens), restarted.source
    status, body = post_generate(l3, text, [b], extra={"mm_hashes": [FORGED]})
    assert status == 400, (status, body)
    got_b = generate(l3, text, [b])
    _assert_no_page_past_image(got_b, text, "B after the restart")
    ref = servers.reference
    want_a = generate(ref, text, [a])
    assert_same(flushed, want_a, "A after /flush_cache")
    assert_same(restarted, want_a, "A after a restart")
    assert_same(got_b, generate(ref, text, [b]), "B after the restart")


@pytest.mark.slow
def test_negative_control_without_the_patches_images_share_pages(servers: Qwen35Servers) -> None:
    """The same requests on a server without mm-hashes-guard, mm-grid-hash and
    input-ids-check: the holes are real."""
    text = chat_text(words(111, 220) + IMAGE_SLOT + words(112, 160))
    a, b = png(113, 128, 128), png(114, 128, 128)
    x, y = transposed_pair(115)
    ref = servers.reference
    want_b, want_y = generate(ref, text, [b]), generate(ref, text, [y])
    bad = servers.unguarded
    try:
        # forged mm_hashes: B gets A's pages from L3 and A's answer
        first = generate(bad, text, [a], extra={"mm_hashes": [FORGED], "session_id": "forged"})
        wait_stored(bad, "forged", first.prompt_tokens)
        bad.flush_cache()
        poisoned = generate(bad, text, [b], extra={"mm_hashes": [FORGED]})
        assert poisoned.cached_storage == restorable(poisoned.prompt_tokens) > image_start(text), poisoned.source
        assert poisoned.logprobs != want_b.logprobs
        # transposed blocks: Y gets X's pages from L3 and X's answer
        bad.flush_cache()
        generate_stored(bad, text, [x], "grid-x")
        bad.flush_cache()
        confused = generate(bad, text, [y])
        assert confused.cached_storage > image_start(text), confused.source
        assert confused.logprobs != want_y.logprobs
        # an id outside the vocabulary next to an image is accepted (and silently dropped)
        ids = tokenizer()(text)["input_ids"]
        status, body = bad.post(
            "/generate",
            {
                "input_ids": ids[:10] + [5000] + ids[10:],
                "image_data": [data_url(png(116, 64, 64))],
                "sampling_params": {"max_new_tokens": 1},
            },
        )
        assert status == 200, (status, body)
    finally:
        servers.stop("unguarded")
