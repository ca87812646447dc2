"""sglang_l3.sessions.pin_book: when a turn that ended in a tool call is pinned, for how
long, and when the pin ends (the HTTP side's rule; the clock is injected)."""

from __future__ import annotations

import pytest
from sglang_l3.sessions import pin_book
from sglang_l3.sessions.pin_book import MAX_PINS, PIN, PinBook
from sglang_l3.sessions.return_prediction import MIN_GAPS


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _turn(b: PinBook, clock: Clock, sid: str, rid: str, gap: float) -> None:
    """sid comes back after gap s, its turn rid runs 1 s and is answered."""
    clock.t += gap
    b.arrived(sid)
    clock.t += 1.0
    b.answered(sid)


def test_the_ttl_is_a_percentile_of_the_sessions_own_gaps():
    clock = Clock()
    b = PinBook(90.0, 300.0, clock)
    _turn(b, clock, "s", "r0", 0)
    for i, gap in enumerate([2.0, 4.0, 6.0, 8.0, 10.0]):
        _turn(b, clock, "s", f"r{i + 1}", gap)
    assert b.ttl("s") == pytest.approx(9.2)  # 90th percentile of 2..10, linear between ranks


def test_no_pin_without_history_then_the_pooled_gaps_of_other_sessions():
    clock = Clock()
    b = PinBook(50.0, 300.0, clock)
    _turn(b, clock, "new", "n0", 0)
    assert b.ttl("new") is None  # nobody has MIN_GAPS gaps yet
    _turn(b, clock, "old", "o0", 0)
    for i in range(MIN_GAPS):
        _turn(b, clock, "old", f"o{i + 1}", 5.0 * (i + 1))
    assert b.ttl("new") == pytest.approx(10.0)  # the pooled median of 5, 10, 15


def test_the_ttl_is_capped():
    clock = Clock()
    b = PinBook(100.0, 30.0, clock)
    _turn(b, clock, "s", "r0", 0)
    for i in range(MIN_GAPS):
        _turn(b, clock, "s", f"r{i + 1}", 1000.0)
    assert b.ttl("s") == 30.0


def test_a_return_ends_the_pin_and_an_expiry_only_its_own_pin():
    clock = Clock()
    b = PinBook(90.0, 300.0, clock)
    p, dropped = b.pin("s", "r1", 10.0)
    assert not dropped and p.expires == 110.0
    assert b.expire("s", "other-rid") is None  # a later pin replaced the one that timed out
    assert b.arrived("s") is p
    assert b.expire("s", "r1") is None  # returned first: nothing to expire
    b.pin("s", "r2", 10.0)
    assert b.expire("s", "r2") is not None and not b.pins


def test_pins_are_bounded_the_oldest_dropped():
    b = PinBook(90.0, 300.0, Clock())
    gone = []
    for i in range(MAX_PINS + 3):
        gone += [d.rid for d in b.pin(f"s{i}", f"r{i}", 5.0)[1]]
    assert gone == ["r0", "r1", "r2"] and len(b.pins) == MAX_PINS
    assert [p.rid for p in b.pin("s5", "r5b", 5.0)[1]] == ["r5"]  # a re-pin replaces the session's pin


@pytest.mark.parametrize("value", ["abc", "0.0001x", "101", "-5"])
def test_a_bad_setting_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("SGLANG_L3_TOOL_PIN", value)
    with pytest.raises(ValueError, match="SGLANG_L3_TOOL_PIN"):
        pin_book.configured()


def test_settings(monkeypatch):
    monkeypatch.delenv("SGLANG_L3_TOOL_PIN", raising=False)
    assert pin_book.configured() is None
    monkeypatch.setenv("SGLANG_L3_TOOL_PIN", "80")
    monkeypatch.setenv("SGLANG_L3_TOOL_PIN_MAX_S", "60")
    assert pin_book.configured() == (80.0, 60.0)
    monkeypatch.setenv("SGLANG_L3_TOOL_PIN_MAX_S", "0")
    with pytest.raises(ValueError, match="SGLANG_L3_TOOL_PIN_MAX_S"):
        pin_book.configured()


class _TM:
    """The tokenizer manager as pin_book sees it: what it would dispatch to the scheduler."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def _dispatch_to_scheduler(self, obj) -> None:
        self.sent.append((obj.parameters["op"], obj.parameters["session"]))


@pytest.fixture
def http_book(monkeypatch):
    """A fresh process-wide pin book, tool pins on, patch tool-pins applied (placed)."""
    monkeypatch.setenv("SGLANG_L3_TOOL_PIN", "90")
    monkeypatch.setattr(pin_book, "_BOOK", None)
    monkeypatch.setattr(pin_book, "_PLACED", True, raising=False)
    b = pin_book.book()
    assert b is not None
    for _ in range(MIN_GAPS):  # pooled gaps: every session gets a TTL
        b.gaps.pooled.append(5.0)
    return b


def test_a_pin_dropped_over_max_pins_is_unpinned_on_the_scheduler_too(http_book):
    import asyncio

    async def run() -> list[tuple[str, str]]:
        tm = _TM()
        for i in range(MAX_PINS + 2):
            pin_book.on_tool_turn(tm, f"r{i}", f"s{i}")
        pin_book.on_tool_turn(tm, "r5b", "s5")  # a re-pin: the scheduler replaces s5's own pin
        for p in http_book.pins.values():
            p.handle.cancel()
        return tm.sent

    sent = asyncio.run(run())
    pins = [s for op, s in sent if op == PIN]
    assert pins == [f"s{i}" for i in range(MAX_PINS + 2)] + ["s5"]
    # each drop is sent before the pin that caused it, so the scheduler's book is the same
    drops = [(i, s) for i, (op, s) in enumerate(sent) if op == pin_book.EXPIRED]
    assert [s for _, s in drops] == ["s0", "s1"]
    assert sent.index((PIN, f"s{MAX_PINS}")) == drops[0][0] + 1
    assert list(http_book.pins) == [f"s{i}" for i in range(2, MAX_PINS + 2) if i != 5] + ["s5"]


def test_no_pin_message_is_sent_while_patch_tool_pins_is_not_applied(http_book, monkeypatch):
    import asyncio

    monkeypatch.setattr(pin_book, "_PLACED", False, raising=False)  # e.g. SGLANG_L3_DISABLE=tool-pins

    async def run() -> list[tuple[str, str]]:
        tm = _TM()
        pin_book.on_answer("s")
        pin_book.on_tool_turn(tm, "r1", "s")
        pin_book.on_arrival(tm, "s")
        return tm.sent

    assert asyncio.run(run()) == []
    assert pin_book.book() is None


def test_patch_tool_pins_places_and_unplaces(monkeypatch):
    from sglang_l3.patches import framework

    monkeypatch.setenv("SGLANG_L3_TOOL_PIN", "90")
    series = framework.load_series()
    assert framework.apply_one(next(s for s in series if s.id == "tool-pins"), series).state == framework.State.APPLIED
    try:
        assert pin_book._PLACED
    finally:
        framework.undo("tool-pins")
    assert not pin_book._PLACED
