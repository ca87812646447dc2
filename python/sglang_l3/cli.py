"""`sglang-l3` command line: doctor | store … | sessions … | plan | top | patches."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# Subcommands contributed by subsystems: module with add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS = (
    ("store", "sglang_l3.storage.cli"),
    ("sessions", "sglang_l3.storage.sessions_cli"),
    ("plan", "sglang_l3.plan.cli"),
    ("top", "sglang_l3.top"),
)


def _doctor(args: argparse.Namespace) -> int:
    from sglang_l3 import doctor

    ok, checks = doctor.run(store_dir=args.store_dir, with_stats=args.stats)
    print(doctor.render(ok, checks, args.json))
    return 0 if ok else 1


def _patches(args: argparse.Namespace) -> int:
    from sglang_l3.patches import fingerprint

    return fingerprint.main(args.targets)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]]:
    parser = argparse.ArgumentParser(prog="sglang-l3", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="check versions, platform, plugin, patches, store")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--stats", action="store_true", help="also print sglang-l3 counters")
    d.add_argument("--store-dir", default=None, help="L3 store directory to check")
    d.set_defaults(func=_doctor)
    p = sub.add_parser("patches", help="print target fingerprints (no args: re-check series.toml)")
    p.add_argument("targets", nargs="*")
    p.set_defaults(func=_patches)
    runners: dict[str, Callable[[argparse.Namespace], int]] = {}
    for name, modname in SUBCOMMANDS:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        mod.add_parser(sub)
        runners[name] = mod.run
    return parser, runners


def main(argv: list[str] | None = None) -> int:
    parser, runners = build_parser()
    args = parser.parse_args(argv)
    if args.command in runners:
        return int(runners[args.command](args))
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
