"""`sglang-l3 top --url http://host:port`: a live terminal view of a running server.

Reads, every --interval seconds, the server's GET /sglang_l3/sessions (the
store's session table, what the HTTP process saw of each session's turns, hints
in flight, the store's bytes against its cap) and GET /metrics (sglang-l3's
counters; the server needs --enable-metrics for the rates). Redraws in place
(ANSI: home + clear) until Ctrl-C; `--once` prints one frame (rates over one
interval) and exits, for scripts.

Per session, explicit (a client's session_id) or implicit (named by the
server, patch `implicit-sessions`): state (speaking: a request in flight;
staging: a "speaks next" hint in flight; retained: an open session, whose pages
the store retains ahead of plain pages, except a one-off implicit one
(`SessionRecord.one_off`); idle), turns, context tokens, the
tokens of its last context on the device now (the scheduler's radix tree,
patch `session-device-tokens`; "-" where the scheduler does not remember the
session), tokens restorable from L3 (the session table's restorable pages x
page size), its L3 bytes, last use, and the last turn's time to first output
with where its prefix came from (device / host / L3, upstream's
cached_tokens_details).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from sglang_l3.storage.cli import fmt_bytes
from sglang_l3.storage.sessions import IMPLICIT_PREFIX, SessionRecord

CLEAR = "\x1b[H\x1b[2J"
_LINE = re.compile(r"^sglang_l3_(\w+)_total\{[^}]*\}\s+([0-9.eE+-]+)$")
# counter (sglang_l3_<name>_total, summed over labels) -> rate column
RATES = (
    ("l3_restores", "restores/s"),
    ("store_read_pages", "pages read/s"),
    ("store_write_pages", "pages written/s"),
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "top",
        help="live view of a running server: sessions, the store against its cap, restores and writes per second",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the server (default %(default)s)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between frames (default %(default)s)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="with --once: the frame's data as JSON")
    p.set_defaults(func=run)


def _get(url: str, path: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as f:
        return f.read()


def counters(text: str) -> dict[str, float]:
    """sglang_l3_<name>_total lines of a /metrics text, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


@dataclass
class Sample:
    at: float
    sessions: dict[str, Any]
    counters: dict[str, float] | None  # None: /metrics not served (no --enable-metrics)
    errors: list[str] = field(default_factory=list)


def sample(url: str) -> Sample:
    errors: list[str] = []
    try:
        sessions = json.loads(_get(url, "/sglang_l3/sessions"))
    except urllib.error.HTTPError as e:
        sessions = {}
        errors.append(f"/sglang_l3/sessions: HTTP {e.code} (no sglang-l3 plugin on this server?)")
    try:
        ctr: dict[str, float] | None = counters(_get(url, "/metrics").decode(errors="replace"))
    except urllib.error.HTTPError:
        ctr = None
    return Sample(time.monotonic(), sessions, ctr, errors)


def rates(a: Sample, b: Sample) -> dict[str, float | None]:
    dt = b.at - a.at
    out: dict[str, float | None] = {}
    for name, label in RATES:
        if a.counters is None or b.counters is None or dt <= 0:
            out[label] = None
        else:
            out[label] = (b.counters.get(name, 0.0) - a.counters.get(name, 0.0)) / dt
    return out


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "-"
    s = max(0.0, now - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit} ago"
    return f"{s:.0f}s ago"


def _source(cached: dict[str, int]) -> str:
    parts = [
        f"{name} {cached[k]}"
        for k, name in (("storage", "L3"), ("host", "host"), ("device", "device"))
        if cached.get(k)
    ]
    return " + ".join(parts) or ("computed" if cached else "-")


def _one_off(sid: str, row: dict[str, Any]) -> bool:
    """The store's own test (`SessionRecord.one_off`) on a row of the session listing."""
    record = SessionRecord(
        sid,
        implicit=row.get("kind") == "implicit",
        turns=int(row.get("turns") or 0),
        tool_calls=int(row.get("tool_calls") or 0),
    )
    return record.one_off()


def session_rows(s: dict[str, Any], page_size: int | None = None) -> list[dict[str, Any]]:
    """One row per session the server knows of (table or request stream), busiest first."""
    table = {r["id"]: r for r in s.get("sessions", []) if "id" in r}
    activity: dict[str, Any] = s.get("activity", {})
    staging = set(s.get("staging", []))
    device = s.get("device_tokens")
    device = device if isinstance(device, dict) else {}
    rows = []
    for sid in sorted(set(table) | set(activity) | set(device)):
        t, a = table.get(sid, {}), activity.get(sid, {})
        if a.get("in_flight"):
            state = "speaking"
        elif sid in staging:
            state = "staging"
        elif t.get("state") == "open" and not _one_off(sid, t):
            state = "retained"  # (a one-off implicit session ranks with closed ones in the store)
        else:
            state = "idle"
        restorable = t.get("restorable_pages")
        rows.append(
            {
                "session": sid,
                "state": state,
                "turns": a.get("turns", 0),
                "implicit": t.get("kind") == "implicit" or sid.startswith(IMPLICIT_PREFIX),
                "context_tokens": a.get("tokens") or t.get("tokens"),
                "device_tokens": device.get(sid),
                "l3_tokens": None if restorable is None or page_size is None else restorable * page_size,
                "l3_pages": restorable,
                "l3_bytes": t.get("bytes"),
                "last_use": max(a.get("last_use") or 0.0, t.get("last_use") or 0.0) or None,
                "last_first_output_s": a.get("first_output_s"),
                "last_source": a.get("cached", {}),
            }
        )
    order = {"speaking": 0, "staging": 1, "retained": 2, "idle": 3}
    rows.sort(key=lambda r: (order[r["state"]], -(r["last_use"] or 0.0)))
    return rows


def frame_data(url: str, prev: Sample, cur: Sample) -> dict[str, Any]:
    s = cur.sessions
    page = _page_size(s)
    return {
        "url": url,
        "store": s.get("store"),
        "store_bytes": s.get("store_bytes"),
        "store_cap_bytes": s.get("store_cap_bytes"),
        "hints": s.get("hints", {}),
        "rates": rates(prev, cur),
        "metrics": cur.counters is not None,
        "sessions": session_rows(s, page),
        "errors": cur.errors,
    }


def _page_size(s: dict[str, Any]) -> int | None:
    page = s.get("page_size")
    return page if isinstance(page, int) and page > 0 else None


def render(d: dict[str, Any], width: int = 120) -> str:
    now = time.time()
    out = [f"sglang-l3 top  {d['url']}  {time.strftime('%H:%M:%S')}"[:width]]
    if d["store"] is None:
        out.append("store: none (not a `--hicache-storage-backend file` server)")
    else:
        cap = d["store_cap_bytes"] or 0
        use = d["store_bytes"] or 0
        cap_txt = f"of {fmt_bytes(cap)} cap ({100.0 * use / cap:.0f}%)" if cap else "(no cap)"
        out.append(f"store: {d['store']}  {fmt_bytes(use)} {cap_txt}")
    if d["metrics"]:
        out.append("  ".join(f"{k} {v:.2f}" for k, v in d["rates"].items() if v is not None) or "rates: first frame")
    else:
        out.append("rates: /metrics not served (start the server with --enable-metrics)")
    hints = ", ".join(f"{k} {v}" for k, v in sorted(d["hints"].items())) or "none"
    out.append(f"hints: {hints}")
    out += d["errors"]
    out.append("")
    head = (
        f"{'SESSION':<24} {'STATE':<9} {'TURNS':>5} {'CONTEXT':>8} {'DEVICE':>8} {'L3 TOKENS':>9} {'L3 BYTES':>9} "
        f"{'LAST USE':>9} {'1ST OUT':>8}  LAST SOURCE"
    )
    out.append(head[:width])
    if not d["sessions"]:
        out.append(
            "(no sessions yet: with the file store, a request of at least one page starts one, with or without session_id)"
        )
    for r in d["sessions"]:
        fo = r["last_first_output_s"]
        line = (
            f"{r['session'][:24]:<24} {r['state']:<9} {r['turns']:>5} {_num(r['context_tokens']):>8} "
            f"{_num(r['device_tokens']):>8} {_num(r['l3_tokens']):>9} {fmt_bytes(r['l3_bytes']) if r['l3_bytes'] is not None else '-':>9} "
            f"{_ago(r['last_use'], now):>9} {f'{fo:.2f}s' if fo is not None else '-':>8}  {_source(r['last_source'])}"
        )
        out.append(line[:width])
    return "\n".join(out)


def _columns() -> int:
    """The terminal's width now (not $COLUMNS: a parent's value goes stale on a resize)."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except OSError:
        return 120


def _num(x: Any) -> str:
    return "-" if x is None else str(x)


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("error: --interval must be > 0", file=sys.stderr)
        return 2
    try:
        prev = sample(args.url)
        if args.once:
            time.sleep(min(args.interval, 1.0))
            d = frame_data(args.url, prev, sample(args.url))
            print(json.dumps(d, indent=1) if args.json else render(d))
            return 0
        cur = prev  # the first frame has no rates yet
        while True:
            d = frame_data(args.url, prev, cur)
            sys.stdout.write(CLEAR + render(d, _columns()) + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
            prev, cur = cur, sample(args.url)
    except KeyboardInterrupt:
        return 0
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"error: {args.url}: {e}", file=sys.stderr)
        return 2
