"""`sglang-l3 top`'s reading of the server's answers (sglang_l3.top): a session's
state, its L3 tokens, the rates from two /metrics samples, and a frame that says
what is missing instead of inventing it. The live view against a server:
test/e2e/test_top_server.py."""

from __future__ import annotations

import time

from sglang_l3 import top
from sglang_l3.sessions.activity import ActivityBook

METRICS = """# HELP sglang_l3_l3_restores_total sglang-l3 l3 restores
sglang_l3_l3_restores_total{reason=""} 3.0
sglang_l3_store_write_pages_total{reason=""} 10.0
sglang_l3_recompute_fallbacks_total{reason="deadline"} 1.0
sglang_l3_recompute_fallbacks_total{reason="damage"} 2.0
sglang:token_usage{model_name="m"} 0.5
"""


def test_counters_sum_labels_and_ignore_upstream_metrics() -> None:
    c = top.counters(METRICS)
    assert c == {"l3_restores": 3.0, "store_write_pages": 10.0, "recompute_fallbacks": 3.0}


def test_rates_per_second_and_none_without_metrics() -> None:
    a = top.Sample(10.0, {}, {"l3_restores": 1.0, "store_write_pages": 4.0})
    b = top.Sample(12.0, {}, {"l3_restores": 3.0, "store_write_pages": 10.0})
    assert top.rates(a, b) == {"restores/s": 1.0, "pages read/s": 0.0, "pages written/s": 3.0}
    assert set(top.rates(a, top.Sample(12.0, {}, None)).values()) == {None}
    assert set(top.rates(a, a).values()) == {None}  # the first frame: no interval yet


def _answer(activity: dict, staging: list[str]) -> dict:
    now = time.time()
    return {
        "store": "/s",
        "page_size": 64,
        "sessions": [
            {"id": "open-one", "state": "open", "tokens": 300, "restorable_pages": 4, "bytes": 1000, "last_use": now},
            {"id": "closed-one", "state": "closed", "tokens": 100, "restorable_pages": 1, "bytes": 10, "last_use": 1.0},
        ],
        "activity": activity,
        "staging": staging,
        "hints": {},
        "store_bytes": 2000,
        "store_cap_bytes": 4000,
    }


def test_states_speaking_staging_retained_idle() -> None:
    book = ActivityBook()
    t0 = book.started("talker")
    book.started("open-one")
    book.finished("open-one", t0, t0 + 0.5, 360, {"meta_info": {"cached_tokens_details": {"storage": 256}}})
    rows = {r["session"]: r for r in top.session_rows(_answer(book.rows(), ["closed-one"]), 64)}
    assert rows["talker"]["state"] == "speaking"
    assert rows["closed-one"]["state"] == "staging"
    assert rows["open-one"]["state"] == "retained"
    assert rows["open-one"]["l3_tokens"] == 4 * 64 and rows["open-one"]["context_tokens"] == 360
    assert rows["open-one"]["last_source"] == {"device": 0, "host": 0, "storage": 256}
    assert rows["open-one"]["last_first_output_s"] == 0.5
    assert [r["session"] for r in top.session_rows(_answer(book.rows(), []), 64)][0] == "talker"
    assert rows2_idle(book)


def rows2_idle(book: ActivityBook) -> bool:
    book.finished("talker", 0.0, None, 0, None)  # aborted before any output: no turn counted
    rows = {r["session"]: r for r in top.session_rows(_answer(book.rows(), []), 64)}
    return rows["talker"]["state"] == "idle" and rows["talker"]["turns"] == 0 and rows["closed-one"]["state"] == "idle"


def test_frame_says_what_is_missing() -> None:
    a = top.Sample(1.0, {"store": None, "sessions": [], "hints": {}}, None)
    text = top.render(top.frame_data("http://x", a, a))
    assert "store: none" in text
    assert "--enable-metrics" in text
    assert "no sessions yet" in text
    assert top.session_rows(_answer({}, []), 64)[0]["device_tokens"] is None  # no answer from the scheduler: unknown
    d = top.frame_data("http://x", a, top.Sample(2.0, _answer({}, []), {"l3_restores": 0.0}))
    text = top.render(d)
    assert "2.0 KiB of 3.9 KiB cap (50%)" in text, text
    assert "rates: first frame" in text  # the previous sample had no counters


def test_device_tokens_and_implicit_sessions() -> None:
    """The scheduler's device tokens go on the session's row ("-" where it does
    not remember the session); an implicit session is a row like any other, and
    one with a single turn and no tool call is not shown retained (the store ranks it
    with closed ones); one whose first turn ended in a tool call is."""
    now = time.time()
    answer = _answer({}, [])
    answer["sessions"] += [
        {"id": "implicit-aa", "state": "open", "kind": "implicit", "turns": 1, "restorable_pages": 2, "last_use": now},
        {"id": "implicit-bb", "state": "open", "kind": "implicit", "turns": 3, "restorable_pages": 5, "last_use": now},
        {"id": "implicit-cc", "state": "open", "kind": "implicit", "turns": 1, "tool_calls": 1, "last_use": now},
    ]
    answer["device_tokens"] = {"open-one": 256, "implicit-bb": 320, "gone-from-table": 64}
    rows = {r["session"]: r for r in top.session_rows(answer, 64)}
    assert rows["open-one"]["device_tokens"] == 256 and rows["closed-one"]["device_tokens"] is None
    assert rows["implicit-bb"]["device_tokens"] == 320 and rows["implicit-bb"]["implicit"]
    assert rows["implicit-bb"]["state"] == "retained" and rows["implicit-aa"]["state"] == "idle"
    assert rows["implicit-cc"]["state"] == "retained"
    assert rows["gone-from-table"]["device_tokens"] == 64 and not rows["gone-from-table"]["implicit"]
    text = top.render(top.frame_data("http://x", top.Sample(1.0, answer, None), top.Sample(2.0, answer, None)))
    line = next(x for x in text.splitlines() if x.startswith("implicit-bb "))
    assert line.split()[:6] == ["implicit-bb", "retained", "0", "-", "320", str(5 * 64)], line


def test_device_tokens_of_internal_states() -> None:
    """Upstream's /get_internal_state answers one state per DP rank: merged; none
    carrying the key (the patch is off, no store) is unknown, not zero."""
    from sglang_l3.sessions.activity import DEVICE_TOKENS_KEY, device_tokens_of

    assert device_tokens_of([{"x": 1}]) is None and device_tokens_of(None) is None
    assert device_tokens_of([{DEVICE_TOKENS_KEY: {}}]) == {}
    got = device_tokens_of([{DEVICE_TOKENS_KEY: {"a": 64}}, {DEVICE_TOKENS_KEY: {"a": 0, "b": 128}}])
    assert got == {"a": 64, "b": 128}
