"""`python -m sglang_l3.patches.fingerprint TARGET...` prints each target's fingerprint
(for a new series.toml entry); with no argument, re-checks every entry in series.toml."""

from __future__ import annotations

import sys

from sglang_l3.patches.framework import PatchError, fingerprint_path, load_series


def main(argv: list[str]) -> int:
    if argv:
        for path in argv:
            print(f'path = "{path}"\nfingerprint = "{fingerprint_path(path)}"')
        return 0
    bad = 0
    for spec in load_series():
        for t in spec.targets:
            try:
                actual = fingerprint_path(t.path)
            except PatchError as e:
                print(f"MISSING {spec.id} {t.path}: {e}")
                bad += 1
                continue
            ok = actual == t.fingerprint
            bad += not ok
            print(f"{'ok     ' if ok else 'DRIFTED'} {spec.id:18s} {t.path} {actual}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
