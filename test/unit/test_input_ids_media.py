"""Patch input-ids-check on the ids inside a preprocessed media item (issue 33 item 4).

A `processor_output` dict in image_data / video_data / audio_data may carry
`input_ids`; upstream's processor takes them as the prompt when the request has no
ids of its own (`BaseMultimodalProcessor._process_and_collect_mm_items`, through
`_ensure_input_ids_is_tensor`, which keeps any value). An id outside the vocabulary
there (a pad value, a negative sentinel, vocab size) is a ValueError naming the item
and position, which the HTTP routes answer with 400, raised on upstream's real
`TokenizerManager._tokenize_one_request` before the processor runs. Negative control:
with the patch undone the request goes on and upstream keeps the ids verbatim.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor
from sglang_l3.patches import framework

VOCAB = 1000
PAD_VALUE = 0x3A7F_19C2_55D0_11E4  # what a hash-derived pad value looks like (>= vocab)


def _tokenize(obj: GenerateReqInput) -> None:
    """Upstream's method as the server calls it (the BEFORE hooks run when it is called;
    a stand-in manager without L3, the coroutine never awaited)."""
    tm = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB), server_args=None)
    TokenizerManager._tokenize_one_request(tm, obj).close()


def _item(ids: Any, fmt: str = "processor_output") -> dict:
    return {"format": fmt, "pixel_values": [[0.0]], "image_grid_thw": [[1, 2, 2]], "input_ids": ids}


GOOD = [1, 2, 3, 999]
BAD = {
    "vocab size": ([1, VOCAB, 3], "input_ids[1] = 1000 is out of range"),
    "negative sentinel": ([-1, 5], "input_ids[0] = -1 is out of range"),
    "pad value": ([7, PAD_VALUE], f"input_ids[1] = {PAD_VALUE} is out of range"),
    "float": ([1, 2.5], "input_ids[1] is 2.5 (float)"),
    "string": ("1 2 3", "input_ids must be a list of integers"),
}


@pytest.mark.parametrize("field", ["image_data", "video_data", "audio_data"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_ids_in_a_media_item_are_refused(field: str, case: str) -> None:
    ids, message = BAD[case]
    for value, where in (([_item(ids)], f"{field}[0]"), ([_item(GOOD), [_item(ids)]], f"{field}[1][0]")):
        with pytest.raises(ValueError) as e:
            _tokenize(GenerateReqInput(text=None, **{field: value}))
        assert str(e.value).startswith(f"{where} (a preprocessed media item): "), str(e.value)
        assert message in str(e.value), str(e.value)


def test_nested_and_tensor_ids_are_checked_flat() -> None:
    # a batch of one, as a processor returns it, and a tensor (the Python API)
    for ids in ([[1, 2, VOCAB]], torch.tensor([[1, 2, VOCAB]])):
        with pytest.raises(ValueError, match=r"image_data\[0\] .*input_ids\[2\] = 1000 is out of range"):
            _tokenize(GenerateReqInput(text=None, image_data=[_item(ids)]))
    _tokenize(GenerateReqInput(text=None, image_data=[_item(torch.tensor([GOOD]))]))


def test_good_ids_and_items_without_ids_pass() -> None:
    _tokenize(GenerateReqInput(text=None, image_data=[_item(GOOD)]))
    _tokenize(GenerateReqInput(text=None, image_data=[_item(None)]))
    _tokenize(GenerateReqInput(text="hi", image_data=["data:image/png;base64,"]))
    # the request's own ids are checked as before
    with pytest.raises(ValueError, match=r"^input_ids\[0\] = -1"):
        _tokenize(GenerateReqInput(input_ids=[-1, 2], image_data=[_item(GOOD)]))


@pytest.fixture
def without_check():
    framework.undo("input-ids-check")
    yield
    framework.apply_one(next(s for s in framework.load_series() if s.id == "input-ids-check"))


def test_negative_control_upstream_keeps_the_ids(without_check) -> None:
    ids = [7, PAD_VALUE, -1]
    _tokenize(GenerateReqInput(text=None, image_data=[_item(ids)]))  # no error before the processor
    # what upstream's processor makes of them: the prompt, verbatim
    assert BaseMultimodalProcessor._ensure_input_ids_is_tensor(ids).tolist() == ids
