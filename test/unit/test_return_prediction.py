"""Issue 31, item 3: predicted return, on a fake clock (no sleeps).

A session's gaps (answer -> its next request) predict when it comes back;
once the percentile of its own gaps has passed, its last context is staged
with an ordinary hint, once per idle period."""

from __future__ import annotations

import asyncio

import pytest
from sglang_l3.sessions import return_prediction as rp
from sglang_l3.sessions.return_prediction import (
    MIN_GAPS,
    ReturnPredictor,
    configured_percentile,
    percentile,
    percentile_setting,
)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _turns(p: ReturnPredictor, clock: _Clock, sid: str, gaps: list[float], run: float = 1.0) -> None:
    """Turns of sid: answer, gap, next request, ..."""
    for g in gaps:
        p.arrived(sid)
        clock.t += run
        p.answered(sid)
        clock.t += g
    p.arrived(sid)
    clock.t += run
    p.answered(sid)


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 25) == 1.25
    assert percentile([5.0], 90) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_a_session_is_due_at_the_percentile_of_its_own_gaps_once():
    clock = _Clock()
    p = ReturnPredictor(50.0, now=clock)
    _turns(p, clock, "a", [2.0, 10.0, 4.0, 6.0])  # median gap 5 s
    p.arrived("b")  # b: one turn, no gap yet
    p.answered("b")
    assert p.expected_gap("a") == 5.0 and p.expected_gap("b") is None
    assert p.due() == []
    clock.t += 4.9
    assert p.due() == []
    clock.t += 0.2
    assert p.due() == ["a"]
    assert p.due() == [], "staged once per idle period"
    clock.t += 1000.0
    assert p.due() == [], "b has no history; a is staged already"
    # a's request comes (late): its gap joins the history, the next idle period may stage again
    p.arrived("a")
    assert p.returned_after_staging == 1 and p.due() == []
    clock.t += 1
    p.answered("a")
    clock.t += p.expected_gap("a")
    assert p.due() == ["a"]


def test_no_prediction_without_history_or_while_running():
    clock = _Clock()
    p = ReturnPredictor(25.0, now=clock)
    _turns(p, clock, "new", [1.0] * (MIN_GAPS - 1))
    clock.t += 100
    assert p.due() == [], "too few gaps to predict"
    _turns(p, clock, "busy", [1.0] * MIN_GAPS)
    p.arrived("busy")  # a request of it is running
    clock.t += 100
    assert p.due() == []


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv("SGLANG_L3_PREDICTED_RETURN", "off")
    assert configured_percentile() is None
    monkeypatch.setenv("SGLANG_L3_PREDICTED_RETURN", "40")
    assert configured_percentile() == 40.0
    for bad in ("0.0", "101", "soon"):
        monkeypatch.setenv("SGLANG_L3_PREDICTED_RETURN", bad)
        with pytest.raises(ValueError, match="percentile"):
            configured_percentile()
    monkeypatch.delenv("SGLANG_L3_PREDICTED_RETURN")
    assert configured_percentile() is None  # off unless asked for


class _TM:
    """Stands in for TokenizerManager.generate_request: records the hints."""

    def __init__(self) -> None:
        self.seen = []

    async def generate_request(self, obj, request=None):
        self.seen.append(obj)
        yield {"meta_info": {"cached_tokens": 0, "finish_reason": {"type": "length"}}}


def test_a_due_session_is_staged_as_a_hint_of_its_last_context(monkeypatch):
    from sglang_l3.sessions.hints import BOOK, HINT_SAMPLING_PARAMS, Prediction, hint_session

    clock = _Clock()
    monkeypatch.setenv("SGLANG_L3_PREDICTED_RETURN", "50")
    pred = Prediction()
    pred.predictor = ReturnPredictor(50.0, now=clock)
    tm = _TM()

    async def main():
        BOOK.remember("agent-p", [5, 6, 7, 8])
        _turns(pred.predictor, clock, "agent-unknown", [3.0, 3.0, 3.0])  # no context known: nothing
        _turns(pred.predictor, clock, "agent-p", [3.0, 3.0, 3.0])
        assert pred.stage_due(tm) == []
        clock.t += 3.0
        (hint,) = pred.stage_due(tm)
        await asyncio.wait_for(hint.done.wait(), 10)
        assert [hint_session(o.rid) for o in tm.seen] == ["agent-p"]
        assert tm.seen[0].input_ids == [5, 6, 7, 8] and tm.seen[0].sampling_params == HINT_SAMPLING_PARAMS
        assert hint.state == "landed"
        assert pred.stage_due(tm) == [] and len(tm.seen) == 1

    try:
        asyncio.run(main())
    finally:
        BOOK.forget("agent-p")


def test_off_means_no_predictor(monkeypatch):
    from sglang_l3.sessions.hints import Prediction

    monkeypatch.setenv("SGLANG_L3_PREDICTED_RETURN", "off")
    pred = Prediction()
    assert pred.predictor is None and pred.stage_due(object()) == []
    assert rp.MAX_GAPS >= MIN_GAPS


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("off", None),
        ("0", None),
        ("", None),
        ("1", 77.0),  # on: the setting's documented default, never the 1st percentile
        ("on", 77.0),
        ("ON", 77.0),
        ("true", 77.0),
        ("90", 90.0),
        ("p90", 90.0),
        ("p1", 1.0),  # the 1st percentile, said so
        ("p0.5", 0.5),
        ("100", 100.0),
    ],
)
def test_percentile_setting_on_means_the_default(monkeypatch, raw, want):
    monkeypatch.setenv("SGLANG_L3_TOOL_PIN", raw)
    assert percentile_setting("SGLANG_L3_TOOL_PIN", 77.0) == want


@pytest.mark.parametrize("raw", ["0.5", "p0", "p", "p101", "101", "-5", "maybe"])
def test_percentile_setting_ambiguous_or_bad_is_an_error(monkeypatch, raw):
    monkeypatch.setenv("SGLANG_L3_TOOL_PIN", raw)
    with pytest.raises(ValueError, match="SGLANG_L3_TOOL_PIN"):
        percentile_setting("SGLANG_L3_TOOL_PIN", 77.0)


def test_on_is_each_settings_documented_default(monkeypatch):
    from sglang_l3.sessions import pin_book

    monkeypatch.setenv("SGLANG_L3_TOOL_PIN", "1")
    monkeypatch.delenv("SGLANG_L3_TOOL_PIN_MAX_S", raising=False)
    monkeypatch.setenv("SGLANG_L3_PREDICTED_RETURN", "on")
    assert pin_book.configured() == (90.0, 300.0)
    assert configured_percentile() == 25.0
