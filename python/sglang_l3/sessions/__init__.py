"""Sessions: the logic behind the `sessions` patch group (implicit sessions, hints and
predicted return, activity for `sglang-l3 top`, tool-call turn pairing, tool pins).
Runs in the serving processes; below `patches/` (imports no patch)."""
