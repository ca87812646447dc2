"""Patch `input-ids-check` (why: patches/series.toml): a request whose
`input_ids` the model cannot embed is a 400 for that request, not the end of
the server.

How: BEFORE `TokenizerManager._validate_one_request` the ids the caller
supplied are checked (ints, 0 <= id < vocab size); a bad one (out of range, a
float, a string, a nested list) raises ValueError naming its position, which
http_server turns into HTTP 400 while the server keeps serving. Ids produced by
the server's own tokenizer or multimodal processor are not re-checked. For a
multimodal request the caller's ids are checked BEFORE
`TokenizerManager._tokenize_one_request`, before the processor decodes them
(the processor's output holds pad values >= vocab size by design). So are the ids
inside a preprocessed media item (a `processor_output` dict in image_data /
video_data / audio_data carrying `input_ids`): upstream's processor takes them as
the prompt when the request has no ids of its own
(`BaseMultimodalProcessor._process_and_collect_mm_items`), and a pad value or any
other id outside the vocabulary there is a 400 naming the item, as everywhere else.
"""

from __future__ import annotations

from typing import Any

from sglang_l3.patches.framework import PatchContext

MEDIA_FIELDS = ("image_data", "video_data", "audio_data")

_TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"


def first_bad_id(ids: Any, vocab_size: int) -> str | None:
    """None when `ids` is a flat list of ints in [0, vocab_size); else why not,
    naming the first bad position."""
    if not isinstance(ids, (list, tuple)):
        return f"input_ids must be a list of integers, got {type(ids).__name__}"
    # fast path: C-level scans (a long prompt costs microseconds per thousand ids)
    if all(type(x) is int for x in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab_size)):
        return None
    for pos, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, int):
            return f"input_ids[{pos}] is {x!r} ({type(x).__name__}), not an integer token id"
        if not 0 <= x < vocab_size:
            return (
                f"input_ids[{pos}] = {x} is out of range: this model's token ids are "
                f"0..{vocab_size - 1} (vocab size {vocab_size})"
            )
    return None


def _check(self: Any, obj: Any, input_ids: Any) -> None:
    # only ids the caller supplied: input_embeds requests carry no ids to embed,
    # and a multimodal processor may substitute its own (pad values) for them
    if getattr(obj, "input_ids", None) is None or getattr(obj, "input_embeds", None) is not None:
        return
    contains_mm = getattr(obj, "contains_mm_input", None)
    if callable(contains_mm) and contains_mm():
        return
    vocab_size = int(self.model_config.vocab_size)
    problem = first_bad_id(input_ids, vocab_size)
    if problem is not None:
        raise ValueError(problem)


def flat_ids(ids: Any) -> Any:
    """A media item's input_ids as one flat list (upstream flattens them: a tensor, or
    nested lists such as a batch of one); anything else is returned as is, for
    `first_bad_id` to name."""
    if hasattr(ids, "tolist"):  # a tensor or an array (the Python API; JSON gives lists)
        ids = ids.tolist()
    if isinstance(ids, (list, tuple)) and any(isinstance(x, (list, tuple)) for x in ids):
        out: list[Any] = []
        for x in ids:
            sub = flat_ids(x)
            out.extend(sub if isinstance(sub, list) else [sub])
        return out
    return ids


def media_ids(values: Any, where: str) -> list[tuple[str, Any]]:
    """(where, input_ids) of every preprocessed media dict in a (nested) list of items."""
    if isinstance(values, dict):
        ids = values.get("input_ids")
        return [] if ids is None else [(where, ids)]
    if isinstance(values, (list, tuple)):
        return [found for i, v in enumerate(values) for found in media_ids(v, f"{where}[{i}]")]
    return []


def _check_mm(self: Any, obj: Any) -> None:
    # a multimodal request's own ids: an id outside the vocabulary is never an image
    # placeholder (upstream's decode of it is a 500, or it is dropped or clamped)
    contains_mm = getattr(obj, "contains_mm_input", None)
    if getattr(obj, "input_ids", None) is not None and callable(contains_mm) and contains_mm():
        problem = first_bad_id(obj.input_ids, int(self.model_config.vocab_size))
        if problem is not None:
            raise ValueError(problem)
    for field in MEDIA_FIELDS:
        for where, ids in media_ids(getattr(obj, field, None), field):
            problem = first_bad_id(flat_ids(ids), int(self.model_config.vocab_size))
            if problem is not None:
                raise ValueError(f"{where} (a preprocessed media item): {problem}")


def apply(ctx: PatchContext) -> None:
    def before(self: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
        _check(self, obj, input_ids)

    def before_tokenize(self: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
        _check_mm(self, obj)

    ctx.before(f"{_TM}._validate_one_request", before)
    ctx.before(f"{_TM}._tokenize_one_request", before_tokenize)
