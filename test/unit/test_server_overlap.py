"""The server launcher runs upstream's overlap scheduler unless asked not to
(the user's serve command keeps upstream's default; `Scheduler.event_loop_overlap`
runs on `--device cpu` too: torch.cpu streams are no-ops, the loop order is real)."""

from __future__ import annotations

from sglang.srt.server_args import prepare_server_args
from sglang_l3.testing.server import ServerConfig


def test_overlap_on_by_default() -> None:
    cfg = ServerConfig()
    assert cfg.overlap_schedule is True
    assert "--disable-overlap-schedule" not in cfg.args(30000)


def test_overlap_off_on_request() -> None:
    args = ServerConfig(overlap_schedule=False).args(30000)
    assert args.count("--disable-overlap-schedule") == 1


def test_upstream_reads_the_default_command_line_as_overlap_on() -> None:
    # no storage_dir: no HiCache, so no store or host-memory checks at parse time
    argv = ServerConfig().args(30000)
    assert prepare_server_args(argv).disable_overlap_schedule is False
    assert prepare_server_args(ServerConfig(overlap_schedule=False).args(30000)).disable_overlap_schedule is True
