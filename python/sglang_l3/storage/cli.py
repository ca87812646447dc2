"""`sglang-l3 store …`: stats, ls, verify, evict, clear for the L3 page store.

Wiring: the top-level `sglang-l3` CLI calls `add_parser(subparsers)` and, for
the `store` command, `run(args)`. Standalone: python -m sglang_l3.storage.cli.
Torch- and sglang-free (starts instantly, safe next to a live server).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from sglang_l3.storage import index
from sglang_l3.storage.config import ConfigError, StoreSettings, fmt_bytes, parse_size
from sglang_l3.storage.safety import UnsafeStoreError, check_dir


def resolve_dir(explicit: Optional[str] = None) -> str:
    """--dir > SGLANG_L3_STORE_DIR > SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR > default."""
    return str(StoreSettings.resolve({"store_dir": explicit} if explicit else {}).root)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("store", help="inspect and manage the L3 page store",
                              description="Inspect and manage the sglang-l3 L3 page store.")
    p.add_argument("--dir", help="store directory (default: $SGLANG_L3_STORE_DIR or ~/.cache/sglang-l3/store)")
    sub = p.add_subparsers(dest="store_cmd", required=True)
    s = sub.add_parser("stats", help="bytes and pages per pool and model, restorable coverage, quarantine")
    s.add_argument("--json", action="store_true")
    s.add_argument("--no-coverage", action="store_true", help="skip reading page headers")
    s = sub.add_parser("ls", help="list pages")
    s.add_argument("--model", help="model digest prefix or model name")
    s.add_argument("--pool")
    s.add_argument("--limit", type=int, default=50, help="0 = all")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("verify", help="re-check every page's header and checksums")
    s.add_argument("--no-quarantine", action="store_true", help="report only; leave bad files in place")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("evict", help="shrink the store (quarantine first, then least recently used pages)")
    s.add_argument("--to", required=True, help="target size, e.g. 200G, 180Gi, 0")
    s = sub.add_parser("clear", help="remove pages (all, or one model's)")
    s.add_argument("--model", help="model digest prefix or model name")
    p.set_defaults(func=run)


def _progress(done: int, total: int, nbytes: int, t0: float) -> None:
    width = 30
    frac = done / total if total else 1.0
    bar = "#" * int(frac * width) + "." * (width - int(frac * width))
    rate = nbytes / max(time.time() - t0, 1e-6)
    sys.stderr.write(f"\r[{bar}] {frac * 100:5.1f}% {done}/{total} pages {fmt_bytes(nbytes)} "
                     f"({fmt_bytes(rate)}/s)")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _print_stats(st: dict) -> None:
    print(f"store {st['root']}: {st['pages']} pages, {fmt_bytes(st['bytes'])}")
    for m in st["models"]:
        print(f"  model {m['mid']} ({m['model']}) shards {','.join(m['shards'])}: "
              f"{m['pages']} pages, {fmt_bytes(m['bytes'])}")
        for pool, v in sorted(m["pools"].items()):
            print(f"    {pool:<12} {v['pages']:>8} pages {fmt_bytes(v['bytes']):>12}")
        cov = m.get("coverage")
        if cov and cov["kv_pages"]:
            note = "" if cov["exact"] else (f" (lower bound: {cov['unknown_links']} pages without a chain "
                                             f"link; set hicache_storage_pass_prefix_keys: true)")
            print(f"    restorable coverage {cov['fraction'] * 100:.1f}% of KV bytes "
                  f"({cov['covered_pages']}/{cov['kv_pages']} pages){note}")
    q = st["quarantined"]
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(q["by_reason"].items()))
    print(f"  quarantined {q['files']} files, {fmt_bytes(q['bytes'])}" + (f" ({reasons})" if reasons else ""))
    if st["strays"] or st["tmp"]:
        print(f"  stray files {st['strays']}, in-flight/leftover tmp files {st['tmp']}")


def run(args: argparse.Namespace) -> int:
    root = resolve_dir(getattr(args, "dir", None))
    cmd = args.store_cmd
    if not os.path.isdir(root):
        print(f"no store at {root}", file=sys.stderr)
        return 0 if cmd in ("stats", "ls") else 1
    try:
        check_dir(root)
    except UnsafeStoreError as e:
        if cmd in ("evict", "clear", "verify"):
            print(f"refusing: {e}", file=sys.stderr)
            return 2
        print(f"warning: {e}", file=sys.stderr)
    if cmd == "stats":
        st = index.stats(index.scan(root, headers=not args.no_coverage), with_coverage=not args.no_coverage)
        if args.json:
            print(json.dumps(st, indent=1, default=list))
        else:
            _print_stats(st)
        return 0
    if cmd == "ls":
        s = index.scan(root)
        mids = index.match_model(s, args.model) if args.model else None
        rows = [p for p in s.pages if (mids is None or p.name.mid in mids)
                and (args.pool is None or p.name.pool == args.pool)]
        rows.sort(key=lambda p: -p.mtime)
        if args.limit:
            rows = rows[: args.limit]
        if args.json:
            print(json.dumps([{"key": p.name.key, "pool": p.name.pool, "model": p.name.mid,
                               "shard": p.name.shard, "bytes": p.size, "mtime": p.mtime} for p in rows]))
        else:
            for p in rows:
                ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p.mtime))
                print(f"{ts}  {fmt_bytes(p.size):>10}  {p.name.pool:<8} {p.name.mid} {p.name.shard:<8} {p.name.key}")
        return 0
    if cmd == "verify":
        t0 = time.time()
        prog = None if args.quiet or args.json else (lambda d, t, b: _progress(d, t, b, t0))
        r = index.verify(root, quarantine=not args.no_quarantine, progress=prog)
        if args.json:
            print(json.dumps(r))
        else:
            for name, reason in r["bad"]:
                print(f"BAD {reason:<16} {name}")
            action = "moved to quarantine" if r["quarantined"] else "left in place"
            print(f"verified {r['checked']} pages ({fmt_bytes(r['bytes'])}): {len(r['bad'])} bad"
                  + (f", {action}" if r["bad"] else ""))
        return 1 if r["bad"] else 0
    if cmd == "evict":
        try:
            target = parse_size(args.to, name="--to")
        except ConfigError as e:
            print(e, file=sys.stderr)
            return 2
        r = index.evict_to(root, target)
        print(f"evicted {r['removed']} files ({fmt_bytes(r['freed_bytes'])}); store now {fmt_bytes(r['now_bytes'])}")
        return 0
    if cmd == "clear":
        r = index.clear(root, args.model)
        if args.model and not r["models"]:
            print(f"no model matches {args.model!r}", file=sys.stderr)
            return 1
        print(f"removed {r['removed']} pages ({fmt_bytes(r['freed_bytes'])})")
        return 0
    print(f"unknown store command {cmd!r}", file=sys.stderr)
    return 2


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-l3")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
