"""Issue 31, item 1 through the real server (CPU, buffer-only L3): requests
without a session_id get implicit sessions.

Two conversations that share only a system prompt, no session_id and no hint
anywhere: the server's table holds two implicit sessions (one per
conversation, the second turn of one of them re-serialising its answer), and
three agents that send one 4-page system prompt and first messages of 1, 20
and 60 tokens are three more (issue 49: page-aligned end points merged them); after
a restart the table keeps them, the next call continues its conversation's
session and comes back from L3; every answer equals the no-cache server's
(tokens and logprobs).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from l3_e2e import (
    CHUNKED_PREFILL,
    LARGE_POOL,
    PAGE_SIZE,
    PREFETCH_THRESHOLD,
    STARTUP_TIMEOUT,
    assert_same_output,
    family_params,
    reference_scenario,
)
from sglang_l3.storage import sessions as table
from sglang_l3.storage.safety import StoreDirs
from sglang_l3.testing.server import Server, ServerConfig, prompt

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW = 12
SYSTEM = prompt(600, 200)  # shared by both conversations
A1 = SYSTEM + prompt(601, 100)
B1 = SYSTEM + prompt(602, 110)
REWRITTEN = prompt(603, NEW)  # the client's re-serialised answer (not the model's tokens)
# Issue 49: agents that send one system prompt of whole pages and short first messages
# (1, 20, 60 tokens) differ only inside the prompt's last page + one; page-aligned end
# points merged them into one session. Each call ends with the chat template's generation prompt (7 tokens,
# as Qwen3.5's "<|im_start|>assistant\n<think>\n"), the same for every agent.
AGENT_SYSTEM = prompt(610, 4 * PAGE_SIZE)
GENERATION_PROMPT = prompt(620, 7)
SHORT_FIRSTS = [AGENT_SYSTEM + prompt(611 + i, n) + GENERATION_PROMPT for i, n in enumerate((1, 20, 60))]


@pytest.fixture(autouse=True)
def _cpu_only(hash_extension_built):
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")


def _a2() -> list[int]:
    return A1 + REWRITTEN + prompt(604, 48)


@reference_scenario(families=("qwen3next",))
def _reference(ref) -> tuple:
    ra1 = ref.generate(A1, NEW)
    rb1 = ref.generate(B1, NEW)
    ra2 = ref.generate(_a2(), NEW)
    a3 = _a2() + ra2.output_ids + prompt(605, 48)
    ra3 = ref.generate(a3, NEW)
    rshort = [ref.generate(x, NEW) for x in SHORT_FIRSTS]
    return ra1, rb1, ra2, a3, ra3, rshort


def _config(store: Path, model: str) -> ServerConfig:
    return ServerConfig(
        model=model,
        storage_dir=str(store),
        device="cpu",
        max_total_tokens=LARGE_POOL,
        chunked_prefill_size=CHUNKED_PREFILL,
        prefetch_threshold=PREFETCH_THRESHOLD,
        page_size=PAGE_SIZE,
    )


def _implicit(store: Path, want: dict[int, int], timeout: float = 60.0) -> dict[int, table.SessionRecord]:
    """The persisted implicit sessions once those with the wanted token counts
    are there ({tokens: turns}); written asynchronously."""
    deadline = time.monotonic() + timeout
    while True:
        recs: list[table.SessionRecord] = []
        with StoreDirs(store, create=False) as dirs:
            for name in table.list_tables(store):
                recs += table.decode(table.read_table_bytes(dirs, name) or b"", None)[1]
        by_tokens = {r.tokens: r for r in recs if r.implicit}
        if all(t in by_tokens and by_tokens[t].turns == n for t, n in want.items()):
            assert all(r.implicit for r in recs), [r.id for r in recs]
            return by_tokens
        if time.monotonic() > deadline:
            raise AssertionError(
                f"implicit sessions {want} not in the table: {[(r.id, r.tokens, r.turns) for r in recs]}"
            )
        time.sleep(0.2)


def _same(got, want, what: str) -> None:
    assert_same_output(got, want, "cpu", what)  # CPU servers: bit for bit


@family_params("qwen3next")
def test_two_conversations_without_session_ids_survive_a_restart(tmp_path, family, reference, capsys):
    from sglang_l3 import cli

    ra1, rb1, ra2, a3, ra3, rshort = _reference(reference)
    reference.stop()  # one server at a time
    store = tmp_path / "store"
    with Server(_config(store, family), tmp_path / "first.log", startup_timeout=STARTUP_TIMEOUT) as s1:
        _same(s1.generate(A1, NEW), ra1, "A turn 1")
        _same(s1.generate(B1, NEW), rb1, "B turn 1")
        _same(s1.generate(_a2(), NEW), ra2, "A turn 2 (answer re-serialised)")
        for i, (x, want) in enumerate(zip(SHORT_FIRSTS, rshort, strict=True)):
            _same(s1.generate(x, NEW), want, f"agent {i} first call")
        shorts = {len(x) + NEW: 1 for x in SHORT_FIRSTS}
        recs = _implicit(store, {len(_a2()) + NEW: 2, len(B1) + NEW: 1, **shorts})
    a_rec, b_rec = recs[len(_a2()) + NEW], recs[len(B1) + NEW]
    assert a_rec.id != b_rec.id, "two conversations sharing a system prompt are two sessions"
    assert len(recs) == 2 + len(SHORT_FIRSTS), "A's two calls are one session, every other call its own"
    assert len({recs[t].id for t in shorts}) == len(SHORT_FIRSTS), "short first calls after one system prompt"
    assert a_rec.open and a_rec.input_pages == len(_a2()) // PAGE_SIZE
    assert len(a_rec.ends) == 2, "the table keeps the end points a restart continues from"
    assert cli.main(["sessions", "--dir", str(store), "ls"]) == 0
    listing = capsys.readouterr().out
    assert a_rec.id[:24] in listing and "implicit" in listing

    with Server(_config(store, family), tmp_path / "restarted.log", startup_timeout=STARTUP_TIMEOUT) as s2:
        g3 = s2.generate(a3, NEW)
        after = _implicit(store, {len(a3) + NEW: 3})
    assert g3.cached_storage >= 256, f"A turn 3 after the restart: {g3.source}"
    _same(g3, ra3, "A turn 3 after a restart")
    assert after[len(a3) + NEW].id == a_rec.id, "the restarted server continues A's session"
    assert b_rec.id in {r.id for r in after.values()}, "the table keeps B across the restart"
