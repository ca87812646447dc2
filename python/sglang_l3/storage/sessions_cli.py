"""`sglang-l3 sessions ls|show|drop`: the persisted session tables of a store.

Offline (torch- and sglang-free): reads `<store>/models/<mid>.sessions` and
the page names in `pages/`, and reports per session what L3 retains for it -
chain pages on disk, the restorable prefix, bytes, last use. `drop` removes a
session from the table (its pages become plain pages, evicted first). A
server using the store rewrites the table on its next change, so an offline
drop needs the server stopped; `--url` works through a running server instead:
ls/show read GET /sglang_l3/sessions, drop sends DELETE
/sglang_l3/sessions/{id} (every scheduler rank's registry forgets it, then
rank 0 rewrites the table).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from sglang_l3.storage import sessions as table
from sglang_l3.storage.cli import fmt_bytes, resolve_dir
from sglang_l3.storage.safety import StoreDirs


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sessions",
        help="agent sessions the L3 store retains (ls / show / drop)",
        description="List, inspect and drop the sessions an L3 store retains.",
    )
    p.add_argument("--dir", help="store directory (default: as for `sglang-l3 store`)")
    p.add_argument(
        "--url",
        help="a running server (http://host:port): ls/show/drop through it (drop reaches every TP rank)",
    )
    sub = p.add_subparsers(dest="sessions_cmd", required=True)
    s = sub.add_parser("ls", help="one line per session")
    s.add_argument("--model", help="model digest prefix or model name")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("show", help="one session in detail")
    s.add_argument("id")
    s.add_argument("--model", help="model digest prefix or model name")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser(
        "drop",
        help="forget a session (its pages become plain, evicted first); offline on --dir "
        "(server stopped) or through a running server with --url",
    )
    s.add_argument("id")
    s.add_argument("--model", help="model digest prefix or model name")
    p.set_defaults(func=run)


def _age(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit} ago"
    return f"{s:.0f}s ago"


def _print_ls(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no sessions")
        return
    print(
        f"{'session':<24} {'kind':<8} {'state':<6} {'prio':>4} {'tokens':>8} {'pages':>11} "
        f"{'restorable':>10} {'bytes':>10}  last use   model"
    )
    for r in rows:
        if "error" in r:
            print(f"  table {r['table']} ignored: {r['error']}")
            continue
        print(
            f"{r['id'][:24]:<24} {r['kind']:<8} {r['state']:<6} {r['priority']:>4} {r['tokens']:>8} "
            f"{r['stored_pages']:>5}/{r['chain_pages']:<5} {r['restorable_pages']:>10} "
            f"{fmt_bytes(r['bytes']):>10}  {_age(r['last_use']):<10} {r['mid'][:12]} ({r['model']})"
        )


def _server(url: str, path: str) -> Any:
    req = urllib.request.Request(url.rstrip("/") + path, method="GET")
    with urllib.request.urlopen(req, timeout=60) as f:
        return json.loads(f.read())


def _drop_on_server(url: str, sid: str) -> int:
    """DELETE /sglang_l3/sessions/{id}: every scheduler rank forgets the session."""
    path = "/sglang_l3/sessions/" + urllib.parse.quote(sid, safe="")
    req = urllib.request.Request(url.rstrip("/") + path, method="DELETE")
    try:
        with urllib.request.urlopen(req, timeout=60) as f:
            json.loads(f.read())
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("error") or str(e)
        except ValueError:
            msg = str(e)
        print(f"error: {url}: {msg}", file=sys.stderr)
        return 1 if e.code == 404 else 2
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"error: {url}: {e}", file=sys.stderr)
        return 2
    print(f"dropped session {sid} on {url} (its pages are now plain)")
    return 0


def run(args: argparse.Namespace) -> int:
    cmd = args.sessions_cmd
    if args.url:
        if cmd == "drop":
            return _drop_on_server(args.url, args.id)
        try:
            out = _server(args.url, "/sglang_l3/sessions")
        except (urllib.error.URLError, OSError, ValueError) as e:
            print(f"error: {args.url}: {e}", file=sys.stderr)
            return 2
        if cmd == "show":
            out = [r for r in out.get("sessions", []) if r.get("id") == args.id]
            if not out:
                print(f"error: no session {args.id!r} on {args.url}", file=sys.stderr)
                return 1
        print(json.dumps(out, indent=1))
        return 0
    root = resolve_dir(args.dir)
    rows = table.session_rows(root, getattr(args, "model", None))
    if cmd == "ls":
        if args.json:
            print(
                json.dumps(
                    [{k: v for k, v in r.items() if k != "keys"} for r in rows],
                    indent=1,
                )
            )
        else:
            _print_ls(rows)
        return 0
    hits = [r for r in rows if r.get("id") == args.id]
    if not hits:
        print(f"error: no session {args.id!r} in {root}", file=sys.stderr)
        return 1
    if cmd == "show":
        for r in hits:
            if args.json:
                print(json.dumps(r, indent=1))
                continue
            print(
                f"session {r['id']} ({r['kind']}, {r['state']}, priority {r['priority']}, {r['turns']} turns) "
                f"model {r['mid']} ({r['model']})"
            )
            print(f"  context: {r['tokens']} tokens, {r['chain_pages']} pages in its chain")
            print(
                f"  on disk: {r['stored_pages']} KV pages, restorable prefix {r['restorable_pages']} pages, "
                f"{fmt_bytes(r['bytes'])} (all pools)"
            )
            print(
                f"  last use: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['last_use']))} "
                f"({_age(r['last_use'])})"
            )
            if r["keys"]:
                print(f"  chain: {r['keys'][0][:16]}… → {r['keys'][-1][:16]}…")
        return 0
    # drop
    with StoreDirs(root, create=False) as dirs:
        for mid in sorted({r["mid"] for r in hits}):
            records, reason = table.load(dirs, mid)
            if reason is not None:
                print(f"error: table of {mid} unusable: {reason}", file=sys.stderr)
                return 1
            table.save(dirs, mid, [r for r in records if r.id != args.id])
            print(
                f"dropped session {args.id} from model {mid[:12]} (its pages are now plain; "
                f"a server using this store rewrites its table on its next change: stop it first)"
            )
    return 0
