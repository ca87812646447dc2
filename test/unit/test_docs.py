"""The RDNA3 serve command is one command: identical in README.md,
docs/install.md and docs/rdna3.md, complete (the settings gfx1100 needs and the
ones an agent needs: Qwen3.5's tool-call and reasoning parsers, its context
length, the cache report), and every flag in it is accepted by upstream's parser
with the plugin applied."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from sglang.srt.server_args import ServerArgs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/install.md", "docs/rdna3.md")
MARK = "<!-- rdna3-serve-command"


def _block(doc: str) -> str:
    text = (ROOT / doc).read_text()
    assert text.count(MARK) == 1, f"{doc}: expected one {MARK} block"
    m = re.search(re.escape(MARK) + r"[^\n]*\n```bash\n(.*?)```", text, re.DOTALL)
    assert m, f"{doc}: no ```bash block after the marker"
    return m.group(1)


def test_one_serve_command_everywhere() -> None:
    blocks = {doc: _block(doc) for doc in DOCS}
    assert len(set(blocks.values())) == 1, blocks


@pytest.mark.parametrize(
    "needle",
    [
        "export SGLANG_MAMBA_CONV_DTYPE=float16",
        "--attention-backend triton",
        "--dtype float16",
        "--quantization gptq",
        "--tp-size 2",
        '"store_dir"',
        "--hicache-storage-backend file --hicache-mem-layout buffer_only",
        "--enable-hierarchical-cache",
        "--sleep-on-idle",  # an idle server must not spin a core (test/e2e/test_idle_server.py)
        # an agent (issue 30): tool calls as tool_calls, thinking as reasoning_content
        "--tool-call-parser qwen3_coder --reasoning-parser qwen3",
        "--context-length 262144",
        "--enable-cache-report",
        # L3 pays per page; upstream's default here is 1 token per page (docs/rdna3.md)
        "--page-size 64",
    ],
)
def test_serve_command_is_complete(needle: str) -> None:
    assert needle in _block("docs/rdna3.md")


def test_serve_command_parses() -> None:
    cmd = _block("docs/rdna3.md").split("python -m sglang.launch_server", 1)[1]
    argv = shlex.split(cmd.replace("\\\n", " "))
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    assert ns.hicache_mem_layout == "buffer_only" and ns.tp_size == 2 and ns.sleep_on_idle
    assert ns.tool_call_parser == "qwen3_coder" and ns.reasoning_parser == "qwen3"
    assert ns.context_length == 262144 and ns.enable_cache_report and ns.page_size == 64


def test_the_parsers_are_qwen35s() -> None:
    """The parsers the command names are the ones for Qwen3.5's output: the XML tool
    call its template asks for, and `<think>` (the generation prompt opens it)."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.function_call.qwen3_coder_detector import Qwen3CoderDetector
    from sglang.srt.parser.reasoning_parser import ReasoningParser
    from sglang_l3.testing.tiny_models import chat_template

    assert FunctionCallParser.ToolCallParserEnum["qwen3_coder"] is Qwen3CoderDetector
    template = chat_template()
    assert "<tool_call>\\n<function=" in template and "<parameter=" in template
    assert "{{- '<think>\\n' }}" in template  # the generation prompt opens the thinking
    assert "qwen3" in ReasoningParser.DetectorMap


def test_agents_doc_matches_the_command() -> None:
    """docs/agents.md explains the flags the command has and Hermes's own keys."""
    text = (ROOT / "docs/agents.md").read_text()
    cmd = _block("docs/rdna3.md")
    for flag in ("--tool-call-parser qwen3_coder", "--reasoning-parser qwen3", "--context-length 262144"):
        assert flag in text and flag in cmd, flag
    for key in ("provider: custom", "base_url:", "context_length: 262144", "max_tokens:"):
        assert key in text, key
