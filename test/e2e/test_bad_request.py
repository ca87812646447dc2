"""One malformed request is a 400 for that request; the server serves on
(patch input-ids-check), for each model family, on the family's no-cache
reference server (conftest `reference`: no HiCache, as before). Without the
patch an id >= the vocabulary size takes the whole server down (IndexError in
VocabParallelEmbedding, then SIGQUIT and kill_process_tree) — run this file with
SGLANG_L3_DISABLE=input-ids-check to see it fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from l3_e2e import family_params, reference_scenario
from sglang_l3.testing.server import prompt, text_config

pytestmark = [pytest.mark.e2e, family_params("qwen3next", "qwen35")]

GOOD = prompt(3, 200)


@reference_scenario
def _good(server) -> None:
    server.generate(GOOD, 8)


def test_bad_input_ids_are_400_and_the_server_keeps_serving(tmp_path: Path, family, reference) -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("cpu-serving patches are not applicable next to an accelerator")
    vocab = int(text_config(family)["vocab_size"])
    good = GOOD
    reference.warm()  # every no-cache answer of the family in this one start
    s = reference.server()
    before = s.generate(good, 8)
    assert before.output_ids == reference.generate(good, 8).output_ids
    bad_cases = {
        "id == vocab size": (good[:50] + [vocab] + good[50:], "input_ids[50]"),
        "negative id": ([-1] + good, "input_ids[0]"),
        # a float is refused by upstream's request schema already (400, no position)
        "float id": (good[:7] + [1.5] + good[7:], None),
    }
    for what, (ids, position) in bad_cases.items():
        status, body = s.post(
            "/generate",
            {
                "input_ids": ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            },
        )
        assert status == 400, f"{what}: HTTP {status} {body}"
        if position is not None:
            assert position in json.dumps(body), f"{what}: {body}"
        assert s.alive(), f"{what}: server died:\n{s.log_tail()}"
    after = s.generate(good, 8)
    assert after.output_ids == before.output_ids
    assert after.logprobs == before.logprobs
