"""`sglang-l3 store …`: stats, ls, verify, evict, clear for the L3 page store.

Wiring: the top-level `sglang-l3` CLI calls `add_parser(subparsers)` and, for
the `store` command, `run(args)`. Standalone: python -m sglang_l3.storage.cli.
Torch- and sglang-free (starts instantly, safe next to a live server).

Every subcommand opens the store through the one safety check the server uses
(safety.check_store): a store the server would refuse is refused here too,
with the reason and the fix, exit code 2, before anything is read or removed.
Exit codes (docs/operations.md): 0 done; 1 nothing to act on (no store, no
model matched) or verify found bad files; 2 bad arguments or an unusable /
unsafe store directory; 3 a destructive command was not confirmed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from sglang_l3.storage import index, writers
from sglang_l3.storage.config import (
    SIZE_EXAMPLES,
    ConfigError,
    StoreSettings,
    fmt_bytes,
    parse_size,
)
from sglang_l3.storage.evictor import fs_usage
from sglang_l3.storage.safety import (
    StoreDirs,
    UnsafeStoreError,
    check_dir,
    valid_model_arg,
)

EXIT_OK, EXIT_NOTHING, EXIT_USAGE, EXIT_UNCONFIRMED = 0, 1, 2, 3
_VALUE_OPTIONS = ("--to", "--limit", "--model", "--pool", "--dir")


def resolve_dir(explicit: str | None = None) -> str:
    """--dir > SGLANG_L3_STORE_DIR > SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR > default."""
    return str(StoreSettings.resolve({"store_dir": explicit} if explicit else {}).root)


class _Parser(argparse.ArgumentParser):
    """Lets a value start with '-' (`--to -5G` reaches the size parser and gets
    its clear error instead of argparse's 'expected one argument')."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        out: list[str] = []
        i = 0
        while i < len(args):
            a = args[i]
            if a in _VALUE_OPTIONS and i + 1 < len(args) and args[i + 1].startswith("-") and args[i + 1] != "--":
                out.append(f"{a}={args[i + 1]}")
                i += 2
                continue
            out.append(a)
            i += 1
        return super().parse_known_args(out, namespace)


def _limit(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of rows (0 = all), got {v!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (all) or more rows, got {v!r}")
    return n


def _model(v: str) -> str:
    if not valid_model_arg(v):
        raise argparse.ArgumentTypeError(
            f"{v!r} is neither a model digest prefix (4+ hex) nor a model name "
            "(printable ASCII: letters, digits, _.@+:=- and / between parts)"
        )
    return v


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "store",
        help="inspect and manage the L3 page store",
        description="Inspect and manage the sglang-l3 L3 page store. Options may follow the subcommand "
        "(`store stats --dir D` = `store --dir D stats`). Exit codes: 0 done; 1 no store, "
        "nothing matched, or verify found bad files; 2 bad arguments or an unsafe/unusable "
        "store directory; 3 a destructive command was not confirmed.",
    )
    dir_help = "store directory (default: $SGLANG_L3_STORE_DIR or ~/.cache/sglang-l3/store)"
    p.add_argument("--dir", help=dir_help)
    sub = p.add_subparsers(dest="store_cmd", required=True, parser_class=_Parser)

    def cmd(name: str, help_: str, description: str = "") -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_, description=description or help_)
        s.add_argument("--dir", default=argparse.SUPPRESS, help=dir_help)
        return s

    s = cmd("stats", "bytes and pages per pool and model, restorable coverage, quarantine")
    s.add_argument("--json", action="store_true")
    s.add_argument("--no-coverage", action="store_true", help="skip reading page headers")
    s = cmd("ls", "list pages, newest first")
    s.add_argument("--model", type=_model, help="model digest prefix (4+ hex) or served model name")
    s.add_argument("--pool", help="pool name (kv, mamba, ...)")
    s.add_argument("--limit", type=_limit, default=50, help="rows to show (default 50; 0 = all)")
    s.add_argument("--json", action="store_true")
    s = cmd(
        "verify",
        "re-check every page's header and checksums",
        "Re-read every page and check its header and every checksum. Bad files are moved to "
        "quarantine/ unless --no-quarantine. Exit 1 if any was bad.",
    )
    s.add_argument("--no-quarantine", action="store_true", help="report only; leave bad files in place")
    s.add_argument(
        "--repair", action="store_true", help="quarantine bad files and remove dead writers' leftover tmp files"
    )
    s.add_argument("--quiet", action="store_true", help="no progress line")
    s.add_argument("--json", action="store_true")
    s = cmd(
        "evict",
        "shrink the store (quarantine first, then least recently used pages)",
        "Shrink pages + quarantine to SIZE: quarantine first, then least recently used pages; "
        "dead writers' tmp files are removed too. Removing more than half of the store asks for "
        "confirmation on a terminal and needs --yes otherwise.",
    )
    s.add_argument(
        "--to",
        required=True,
        metavar="SIZE",
        help=f"target size, e.g. {SIZE_EXAMPLES.replace('%', '%%')} (N%% = of the filesystem holding the store); "
        "0 empties the store (asks first)",
    )
    s.add_argument("--yes", "-y", action="store_true", help="do not ask; required when stdin is not a terminal")
    s.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    s = cmd(
        "clear",
        "remove pages (all, or one model's)",
        "Remove every page, the quarantine and dead writers' tmp files, or one model's pages. "
        "Asks for confirmation on a terminal and needs --yes otherwise.",
    )
    s.add_argument("--model", type=_model, help="model digest prefix (4+ hex) or served model name")
    s.add_argument("--yes", "-y", action="store_true", help="do not ask; required when stdin is not a terminal")
    s.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    p.set_defaults(func=run)


def _err(msg: str) -> None:
    print(f"sglang-l3 store: {msg}", file=sys.stderr)


class _Progress:
    """One status line on stderr, rewritten in place: `\\r` + text + clear to
    end of line, so a shorter line leaves nothing of a longer one behind."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.last = 0.0

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        now = time.time()
        if done != total and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        frac = done / total if total else 1.0
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        rate = nbytes / max(now - self.t0, 1e-6)
        sys.stderr.write(
            f"\r[{bar}] {frac * 100:5.1f}% {done}/{total} pages {fmt_bytes(nbytes)} ({fmt_bytes(rate)}/s)\x1b[K"
        )
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _confirm(what: str, yes: bool) -> bool:
    """--yes, or an explicit 'y' on a terminal. Never assumes consent."""
    if yes:
        return True
    if not sys.stdin.isatty():
        _err(
            f"{what}: not confirmed. Standard input is not a terminal; re-run with --yes to proceed "
            "(--dry-run shows what would go). Nothing was removed."
        )
        return False
    sys.stderr.write(f"{what}. Proceed? [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        _err("not confirmed; nothing was removed.")
        return False
    return True


def _print_stats(st: dict) -> None:
    print(f"store {st['root']}: {st['pages']} pages, {fmt_bytes(st['bytes'])}")
    for m in st["models"]:
        print(
            f"  model {m['mid']} ({m['model']}) shards {','.join(m['shards'])}: "
            f"{m['pages']} pages, {fmt_bytes(m['bytes'])}"
        )
        for pool, v in sorted(m["pools"].items()):
            print(f"    {pool:<12} {v['pages']:>8} pages {fmt_bytes(v['bytes']):>12}")
        cov = m.get("coverage")
        if cov and cov["kv_pages"]:
            note = (
                ""
                if cov["exact"]
                else (
                    f" (lower bound: {cov['unknown_links']} pages without a chain "
                    f"link; set hicache_storage_pass_prefix_keys: true)"
                )
            )
            print(
                f"    restorable coverage {cov['fraction'] * 100:.1f}% of KV bytes "
                f"({cov['covered_pages']}/{cov['kv_pages']} pages){note}"
            )
    q = st["quarantined"]
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(q["by_reason"].items()))
    print(f"  quarantined {q['files']} files, {fmt_bytes(q['bytes'])}" + (f" ({reasons})" if reasons else ""))
    if st["strays"] or st["tmp"]:
        print(
            f"  stray files {st['strays']}, in-flight/leftover tmp files {st['tmp']} "
            "(dead writers' tmp files go with evict, clear or verify --repair)"
        )


def open_store(root: str) -> tuple[StoreDirs | None, int]:
    """The one entry check of every subcommand: (dirs, 0) or (None, exit code)."""
    hint = "give the store directory with --dir DIR (or set SGLANG_L3_STORE_DIR)"
    if not os.path.lexists(root):
        _err(f"no store at {root}; {hint}.")
        return None, EXIT_NOTHING
    try:
        check_dir(root)  # a file, a dangling link, another user's or a writable directory
    except UnsafeStoreError as e:
        _err(f"cannot use {root}: {e}")
        return None, EXIT_USAGE
    if not os.path.isdir(os.path.join(root, "pages")) and not os.path.islink(os.path.join(root, "pages")):
        _err(f"no store at {root} (it has no pages/ directory); {hint}.")
        return None, EXIT_NOTHING
    try:
        return StoreDirs(root, create=False), EXIT_OK
    except UnsafeStoreError as e:
        _err(f"cannot use {root}: {e}")
        return None, EXIT_USAGE
    except OSError as e:
        _err(f"cannot open store {root}: {e}")
        return None, EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    try:
        root = resolve_dir(getattr(args, "dir", None))
    except ConfigError as e:
        _err(str(e))
        return EXIT_USAGE
    cmd = args.store_cmd
    target = None
    if cmd == "evict":  # arguments first: a bad value is an error even without a store
        try:
            parse_size(args.to, name="--to", fs_total=1, strict=True)
        except ConfigError as e:
            _err(str(e))
            return EXIT_USAGE
    dirs, rc = open_store(root)
    if dirs is None:
        return rc
    try:
        if cmd == "evict":
            target = parse_size(args.to, name="--to", fs_total=fs_usage(str(dirs.root))[0], strict=True)
        return _COMMANDS[cmd](dirs, args, target)
    finally:
        dirs.close()


def _stats(dirs: StoreDirs, args: argparse.Namespace, _t: Any) -> int:
    st = index.stats(index.scan(dirs, headers=not args.no_coverage), with_coverage=not args.no_coverage)
    if args.json:
        print(json.dumps(st, indent=1, default=list))
    else:
        _print_stats(st)
    return EXIT_OK


def _ls(dirs: StoreDirs, args: argparse.Namespace, _t: Any) -> int:
    s = index.scan(dirs)
    mids = index.match_model(s, args.model) if args.model else None
    if mids is not None and not mids:
        known = ", ".join(sorted(f"{m.get('model', '?')} ({mid})" for mid, m in s.models.items())) or "none"
        _err(f"no model matches {args.model!r} (known: {known}); nothing listed.")
        return EXIT_NOTHING
    rows = [
        p for p in s.pages if (mids is None or p.name.mid in mids) and (args.pool is None or p.name.pool == args.pool)
    ]
    rows.sort(key=lambda p: (-p.mtime, p.path))
    matching = len(rows)
    if args.limit:
        rows = rows[: args.limit]
    cut = len(rows) < matching
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "key": p.name.key,
                        "pool": p.name.pool,
                        "model": p.name.mid,
                        "shard": p.name.shard,
                        "bytes": p.size,
                        "mtime": p.mtime,
                    }
                    for p in rows
                ]
            )
        )
        if cut:
            _err(f"showing {len(rows)} of {matching} pages; --limit 0 shows all")
        return EXIT_OK
    print(f"{'modified':<19}  {'size':>10}  {'pool':<8} {'model':<12} {'shard':<8} key")
    for p in rows:
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p.mtime))
        print(f"{ts}  {fmt_bytes(p.size):>10}  {p.name.pool:<8} {p.name.mid:<12} {p.name.shard:<8} {p.name.key}")
    if cut:
        print(f"{len(rows)} of {matching} pages shown (newest first; --limit 0 shows all)")
    else:
        print(f"{matching} page{'s' if matching != 1 else ''}")
    return EXIT_OK


def _verify(dirs: StoreDirs, args: argparse.Namespace, _t: Any) -> int:
    prog = None if args.quiet or args.json else _Progress()
    r = index.verify(dirs, quarantine=not args.no_quarantine or args.repair, repair=args.repair, progress=prog)
    if args.json:
        print(json.dumps(r))
    else:
        for name, reason in r["bad"]:
            print(f"BAD {reason:<16} {name}")
        action = "moved to quarantine" if r["quarantined"] else "left in place"
        print(
            f"verified {r['checked']} pages ({fmt_bytes(r['bytes'])}): {len(r['bad'])} bad"
            + (f", {action}" if r["bad"] else "")
        )
        if args.repair:
            print(f"removed {r['tmp_removed']} leftover tmp files of dead writers ({fmt_bytes(r['tmp_freed_bytes'])})")
    return EXIT_NOTHING if r["bad"] else EXIT_OK


def _evict(dirs: StoreDirs, args: argparse.Namespace, target: int) -> int:
    s = index.scan(dirs)
    total = index.store_bytes(s)
    victims = index.plan_evict(s, target)
    freeing = sum(b for _, _, b in victims)
    what = f"evict {len(victims)} files ({fmt_bytes(freeing)} of {fmt_bytes(total)}) to reach {fmt_bytes(target)}"
    if args.dry_run:
        print(f"dry run: would {what}; nothing removed")
        return EXIT_OK
    if victims and freeing * 2 > total and not _confirm(f"{what}: more than half of the store", args.yes):
        return EXIT_UNCONFIRMED
    removed, freed = index.remove(dirs, victims)
    tmp, tmp_bytes = writers.sweep_tmp(dirs)
    print(
        f"evicted {removed} files ({fmt_bytes(freed)}); store now {fmt_bytes(total - freed)}"
        + (f"; removed {tmp} leftover tmp files ({fmt_bytes(tmp_bytes)})" if tmp else "")
    )
    return EXIT_OK


def _clear(dirs: StoreDirs, args: argparse.Namespace, _t: Any) -> int:
    s = index.scan(dirs)
    victims, mids = index.plan_clear(s, args.model)
    if args.model and not mids:
        known = ", ".join(sorted(f"{m.get('model', '?')} ({mid})" for mid, m in s.models.items())) or "none"
        _err(f"no model matches {args.model!r} (known: {known}); nothing removed.")
        return EXIT_NOTHING
    pages = [v for v in victims if v[0] == "pages" and index.page_name_of(v[1]) is not None]
    n_pages, nbytes = len(pages), sum(b for _, _, b in victims)
    scope = f"model {', '.join(sorted(mids))}" if mids else "the whole store"
    what = f"remove {n_pages} pages ({fmt_bytes(nbytes)} with quarantine/strays) of {scope} at {dirs.root}"
    if args.dry_run:
        print(f"dry run: would {what}; nothing removed")
        return EXIT_OK
    if victims and not _confirm(what, args.yes):
        return EXIT_UNCONFIRMED
    removed, freed = index.remove(dirs, pages)
    _, freed_rest = index.remove(dirs, [v for v in victims if v not in pages])
    tmp, _ = writers.sweep_tmp(dirs) if mids is None else (0, 0)
    print(
        f"removed {removed} pages ({fmt_bytes(freed + freed_rest)})"
        + (f"; removed {tmp} leftover tmp files of dead writers" if tmp else "")
    )
    return EXIT_OK


_COMMANDS: dict[str, Callable[[StoreDirs, argparse.Namespace, Any], int]] = {
    "stats": _stats,
    "ls": _ls,
    "verify": _verify,
    "evict": _evict,
    "clear": _clear,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-l3")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
