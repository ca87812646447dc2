"""Run the real hermes-agent (NousResearch, pinned in requirements/hermes.txt) the way
a user runs it, in a sandbox: its own venv (`.venv-hermes` at the repository root,
built by `make install`; HERMES=0 skips it), a temporary HOME and HERMES_HOME with a
`config.yaml` that points its `custom` provider at the test server (docs/agents.md),
a working directory it may write in (HERMES_WRITE_SAFE_ROOT) and only the `file`
toolset (read_file, write_file, patch, search_files: no terminal, no web). What the
agent reads and writes is decided by the scripted model (patch scripted-decode),
so every path it touches is one the test put in the script, inside the sandbox.

    if (why := missing_reason()): pytest.skip(why)
    box = Sandbox.create(tmp / "agent-a", base_url=server.base + "/v1", model="tiny")
    done = box.run("Copy notes.txt to out.txt")   # `hermes -z PROMPT -t file`
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import sglang_l3

ROOT = Path(sglang_l3.__file__).resolve().parents[2]
VENV = ROOT / ".venv-hermes"
PIN = "hermes-agent==0.19.0"
TOOLSETS = "file"  # read_file, write_file, patch, search_files


def hermes_bin() -> Path:
    return VENV / "bin" / "hermes"


def missing_reason() -> str | None:
    """Why the agent tests cannot run here (None: they can)."""
    if not hermes_bin().exists():
        return f"hermes-agent is not installed in {VENV} (`make install`, or `make install-hermes`; HERMES=0 skips it)"
    return None


@dataclass
class Sandbox:
    root: Path
    home: Path
    work: Path

    @classmethod
    def create(
        cls,
        root: Path,
        *,
        base_url: str,
        model: str,
        context_length: int,
        max_tokens: int | None = None,
        compression_threshold: float | None = None,
        compression: dict[str, float | int] | None = None,
    ) -> Sandbox:
        """A fresh HOME (with .hermes/config.yaml) and working directory under `root`.
        `compression`: more keys of Hermes's `compression` section (protect_first_n,
        protect_last_n, target_ratio), with compression enabled."""
        home, work = root / "home", root / "work"
        (home / ".hermes").mkdir(parents=True)
        work.mkdir(parents=True)
        lines = [
            "model:",
            "  provider: custom",
            f"  base_url: {base_url}",
            f"  default: {model}",
            "  api_key: none",
            f"  context_length: {context_length}",
        ]
        if max_tokens is not None:
            lines.append(f"  max_tokens: {max_tokens}")
        lines += [f"toolsets: [{TOOLSETS}]", "memory:", "  memory_enabled: false", "  user_profile_enabled: false"]
        if compression_threshold is not None or compression:
            lines += ["compression:", "  enabled: true"]
            if compression_threshold is not None:
                lines.append(f"  threshold: {compression_threshold}")
            lines += [f"  {k}: {v}" for k, v in (compression or {}).items()]
        (home / ".hermes" / "config.yaml").write_text("\n".join(lines) + "\n")
        return cls(root=root, home=home, work=work)

    def env(self) -> dict[str, str]:
        """Only what a shell gives a user, re-rooted in the sandbox: no proxy or
        credential variables of the test process leak in."""
        keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in os.environ}
        return {
            **keep,
            "HOME": str(self.home),
            "HERMES_HOME": str(self.home / ".hermes"),
            "HERMES_WRITE_SAFE_ROOT": str(self.work),
            "TERM": "dumb",
            "NO_COLOR": "1",
        }

    def run(self, prompt: str, timeout: float = 1800.0) -> subprocess.CompletedProcess[str]:
        """`hermes -z PROMPT -t file` in the working directory; its final answer on stdout."""
        cmd = [str(hermes_bin()), "-z", prompt, "-t", TOOLSETS, "--usage-file", str(self.root / "usage.json")]
        return subprocess.run(
            cmd,
            cwd=self.work,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
