"""`sglang-l3 top`'s reading of the server's answers (sglang_l3.top): a session's
state, its L3 tokens, the rates from two /metrics samples, and a frame that says
what is missing instead of inventing it. The live view against a server:
test/e2e/test_top_server.py."""

from __future__ import annotations

import time

from sglang_l3 import top
from sglang_l3.session_activity import ActivityBook

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


def test_states_speaking_staging_pinned_idle() -> None:
    book = ActivityBook()
    t0 = book.started("talker")
    book.started("open-one")
    book.finished("open-one", t0, t0 + 0.5, 360, {"meta_info": {"cached_tokens_details": {"storage": 256}}})
    rows = {r["session"]: r for r in top.session_rows(_answer(book.rows(), ["closed-one"]), 64)}
    assert rows["talker"]["state"] == "speaking"
    assert rows["closed-one"]["state"] == "staging"
    assert rows["open-one"]["state"] == "pinned"
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
    assert "requests without session_id are not shown" in text
    d = top.frame_data("http://x", a, top.Sample(2.0, _answer({}, []), {"l3_restores": 0.0}))
    text = top.render(d)
    assert "2.0 KiB of 3.9 KiB cap (50%)" in text, text
    assert "rates: first frame" in text  # the previous sample had no counters
