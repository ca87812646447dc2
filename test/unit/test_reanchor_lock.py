"""reanchor's shared bookkeeping (_STATE.releases / _STATE.by_request) is read and
written by the scheduler thread and the ack path: every access holds _STATE.lock.
Checked on the source (a race cannot be provoked deterministically)."""

from __future__ import annotations

import ast
import inspect

from sglang_l3.patches.hicache import reanchor


def unlocked_accesses(source: str) -> list[int]:
    tree = ast.parse(source)
    locked: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(ast.unparse(item.context_expr) == "_STATE.lock" for item in node.items):
            locked |= {id(n) for n in ast.walk(node)}
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("releases", "by_request")
        and ast.unparse(node.value) == "_STATE"
        and id(node) not in locked
    ]


def test_shared_state_only_under_its_lock() -> None:
    assert unlocked_accesses(inspect.getsource(reanchor)) == []


def test_the_check_sees_an_unlocked_access() -> None:
    src = "def f(r):\n    with _STATE.lock:\n        _STATE.releases[r] = 0\n    return _STATE.releases.pop(r)\n"
    assert unlocked_accesses(src) == [4]
