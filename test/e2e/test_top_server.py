"""`sglang-l3 top` against a real CPU server, used as a person would: in a
terminal (a private tmux server), with two agents' turns going on.

The live view draws in place (one frame on the screen, never scrolled
copies), shows each session's row (turns, its tokens on the device, where its
last prefix came from) and picks up a turn that lands while it runs; Ctrl-C
ends it. `--once --json` gives a script the same rows: the store's bytes
against its cap, the turn restored from L3, a plain client's conversation
(no session_id) as an implicit session's row, and every session's device
tokens at 0 after the device is flushed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest
from l3_e2e import CHUNKED_PREFILL, P_LEN, PAGE_SIZE, PREFETCH_THRESHOLD, STARTUP_TIMEOUT, P, restorable
from sglang_l3.testing.server import Server, ServerConfig, prompt

pytestmark = pytest.mark.e2e

CAP = 64 * 2**20
NEW = 8


def _top(url: str, *args: str) -> list[str]:
    env = f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}"
    return ["env", env, sys.executable, "-m", "sglang_l3.cli", "top", "--url", url, *args]


def _until(fn, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what}; last: {got!r}")


def _full_pages(context: int) -> int:
    """Device tokens of a finished context: its full pages, the last output token's
    KV never computed."""
    return (context - 1) // PAGE_SIZE * PAGE_SIZE


def _row(screen: str, sid: str) -> list[str]:
    for line in screen.splitlines():
        if line.startswith(sid + " "):
            return line.split()
    return []


def test_top_live_in_a_terminal_and_once(tmp_path, hash_extension_built) -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("the CPU server variant needs a machine without an accelerator")
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    store = tmp_path / "store"
    cfg = ServerConfig(
        storage_dir=str(store),
        chunked_prefill_size=CHUNKED_PREFILL,
        prefetch_threshold=PREFETCH_THRESHOLD,
        page_size=PAGE_SIZE,
        storage_extra_config={"max_bytes": CAP, "min_free_bytes": 0},
        extra_args=["--enable-metrics"],
    )
    sock = f"sglang-l3-top-{os.getpid()}"
    tmux = ["tmux", "-L", sock]
    with Server(cfg, tmp_path / "server.log", startup_timeout=STARTUP_TIMEOUT) as s:
        # planner: a turn, its context off the device, a second turn from L3; coder: one turn
        p1 = s.generate(P, NEW, extra={"session_id": "planner"})
        s.flush_cache()
        p2 = s.generate(P + p1.output_ids + prompt(5, 40), NEW, extra={"session_id": "planner"})
        assert p2.cached_storage == restorable(P_LEN), p2.meta
        s.generate(prompt(6, 200), NEW, extra={"session_id": "coder"})
        # a plain client's agent: no session_id; its second call extends the first
        plain = prompt(8, 200)
        o1 = s.generate(plain, NEW)
        o2 = s.generate(plain + o1.output_ids + prompt(9, 40), NEW)
        plain_ctx = len(plain) + len(o1.output_ids) + 40 + len(o2.output_ids)
        planner_ctx = P_LEN + len(p1.output_ids) + 40 + len(p2.output_ids)

        try:
            subprocess.run(
                [
                    *tmux,
                    "new-session",
                    "-d",
                    "-s",
                    "top",
                    "-x",
                    "150",
                    "-y",
                    "30",
                    shlex.join(_top(s.base, "--interval", "1")),
                ],
                check=True,
            )
            subprocess.run([*tmux, "set-option", "-t", "top", "remain-on-exit", "on"], check=True)

            def screen() -> str:
                return subprocess.run(
                    [*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True, check=True
                ).stdout

            # a frame after the first has the rates (the first has no interval yet)
            shown = _until(
                lambda: (lambda t: t if _row(t, "coder") and "restores/s" in t else "")(screen()),
                "no coder row and rates on the screen",
            )
            planner = _row(shown, "planner")
            # SESSION STATE TURNS CONTEXT DEVICE ... LAST SOURCE: two turns, the last one's prefix
            # from L3, its whole context on the device again but the last output token's page
            assert planner[2] == "2" and planner[3] == str(planner_ctx), shown
            assert planner[4] == str(_full_pages(planner_ctx)), shown
            assert f"L3 {restorable(P_LEN)}" in " ".join(planner), shown
            assert "restores/s" in shown and "pages written/s" in shown, shown
            assert "of 64.0 MiB cap" in shown, shown

            # a turn while the view runs: the coder's row shows it on a later frame, in place
            s.generate(prompt(6, 200) + prompt(7, 40), NEW, extra={"session_id": "coder"})
            shown = _until(lambda: (lambda t: t if _row(t, "coder")[2:3] == ["2"] else "")(screen()), "coder turn 2")
            assert shown.count("SESSION") == 1 and shown.count("sglang-l3 top") == 1, shown

            subprocess.run([*tmux, "send-keys", "-t", "top", "C-c"], check=True)

            def dead() -> bool:
                out = subprocess.run(
                    [*tmux, "display-message", "-p", "-t", "top", "#{pane_dead}"], capture_output=True, text=True
                )
                return out.stdout.strip() == "1"

            _until(dead, "top did not end on Ctrl-C", timeout=30)
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True)

        out = subprocess.run(_top(s.base, "--once", "--json"), capture_output=True, text=True, timeout=120, check=True)
        d = json.loads(out.stdout)
        rows = {r["session"]: r for r in d["sessions"]}
        implicit = [r for r in rows if r.startswith("implicit-")]
        assert set(rows) - set(implicit) == {"planner", "coder"} and len(implicit) == 1, rows
        agent = rows[implicit[0]]
        assert agent["implicit"] and agent["turns"] == 2 and agent["context_tokens"] == plain_ctx, agent
        assert agent["device_tokens"] == _full_pages(plain_ctx) and agent["state"] == "retained", agent
        assert rows["planner"]["turns"] == 2 and rows["planner"]["last_source"]["storage"] == restorable(P_LEN)
        assert rows["planner"]["state"] in ("retained", "idle") and rows["planner"]["l3_bytes"] > 0, rows
        assert d["store_cap_bytes"] == CAP and 0 < d["store_bytes"] <= CAP, d
        assert d["metrics"] is True and set(d["rates"]) == {"restores/s", "pages read/s", "pages written/s"}

        # the device flushed: every session's context is off it, still in L3
        s.flush_cache()
        out = subprocess.run(_top(s.base, "--once", "--json"), capture_output=True, text=True, timeout=120, check=True)
        rows = {r["session"]: r for r in json.loads(out.stdout)["sessions"]}
        assert {k: r["device_tokens"] for k, r in rows.items()} == dict.fromkeys(rows, 0), rows
        assert rows["planner"]["l3_tokens"] > 0, rows
