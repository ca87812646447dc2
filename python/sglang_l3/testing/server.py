"""Start, talk to and stop a real `python -m sglang.launch_server` serving the
packaged tiny Qwen3-Next (used by `python -m sglang_l3.testing.demo_server` and test/e2e).

Nothing here changes the server's behaviour: it builds the command line, waits
for the server to be ready, sends HTTP requests with input ids
(--skip-tokenizer-init) and reads what the server reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import sglang_l3

TINY_MODEL_DIR = Path(sglang_l3.__file__).resolve().parent / "models" / "tiny-qwen3next"
READY_LINE = "The server is fired up"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm_hicache_hash_extension() -> None:
    """Build (once per machine) the C++ page-hash extension HiCache loads lazily.

    Upstream compiles it on first use inside the storage prefetch thread
    (mem_cache/cpp_utils/native_hash.py); on a slow or busy machine that takes
    longer than the 10 s `/flush_cache` waits for the thread to stop
    (cache_controller.py:518-531), and the scheduler dies with "Failed to stop
    HiCache storage threads cleanly". Building it beforehand avoids that.
    """
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    _load_native_hash_module()


@dataclass
class ServerConfig:
    """What the CPU L3 server is started with (defaults: the demo/e2e settings)."""

    storage_dir: Optional[str] = None  # None: no HiCache at all
    device: str = "cpu"
    max_total_tokens: int = 4096
    max_mamba_cache_size: int = 32
    max_running_requests: int = 8
    chunked_prefill_size: Optional[int] = None
    page_size: Optional[int] = None
    prefetch_threshold: Optional[int] = None
    storage_extra: dict[str, Any] = field(default_factory=dict)  # more extra-config keys
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def args(self, port: int) -> list[str]:
        a = [
            "--model-path", str(TINY_MODEL_DIR),
            "--load-format", "dummy",
            "--skip-tokenizer-init",
            "--device", self.device,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--max-total-tokens", str(self.max_total_tokens),
            "--max-running-requests", str(self.max_running_requests),
            "--max-mamba-cache-size", str(self.max_mamba_cache_size),
            "--mamba-radix-cache-strategy", "extra_buffer",
            "--disable-overlap-schedule",
        ]
        if self.device == "cpu":
            a += ["--attention-backend", "torch_native", "--disable-cuda-graph"]
        else:
            # a tiny model on a big GPU: Triton attention (no FlashInfer needed), a
            # small static fraction (the pools are capped by the token counts above)
            a += ["--attention-backend", "triton", "--mem-fraction-static", "0.2"]
        if self.chunked_prefill_size is not None:
            a += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.page_size is not None:
            a += ["--page-size", str(self.page_size)]
        if self.storage_dir is not None:
            a += [
                "--enable-hierarchical-cache",
                "--hicache-storage-backend", "file",
                "--hicache-mem-layout", "buffer_only",
            ]
            extra = dict(self.storage_extra)
            if self.prefetch_threshold is not None:
                extra["prefetch_threshold"] = self.prefetch_threshold
            if extra:
                a += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
        return a + list(self.extra_args)


class ServerError(RuntimeError):
    pass


class Server:
    """One server process on a free loopback port; a context manager."""

    def __init__(self, config: ServerConfig, log_path: str | os.PathLike, *,
                 startup_timeout: float = 300.0, python: str = sys.executable):
        self.config = config
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.python = python
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------- lifecycle
    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", *self.config.args(self.port)]

    def start(self) -> "Server":
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.config.storage_dir is not None:
            Path(self.config.storage_dir).mkdir(parents=True, exist_ok=True)
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(self.config.storage_dir)
        env.update(self.config.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise ServerError(f"server exited with {code} during start-up; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            if READY_LINE in self.log_text():
                return
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"server not ready after {self.startup_timeout:.0f} s; "
                          f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group (launcher, scheduler, detokenizer:
        started in a session of its own), SIGKILL what is left after `timeout`."""
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # the launcher or any child still in the group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, body: Any = None, timeout: float = 300.0) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base + path, data=data, method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as f:
                return f.read()
        except (urllib.error.URLError, ConnectionError) as e:
            if not self.alive():
                raise ServerError(f"server died; log {self.log_path}:\n{self.log_tail()}") from e
            raise

    def generate(self, input_ids: list[int], max_new_tokens: int = 8,
                 extra: Optional[dict[str, Any]] = None) -> "Generation":
        """Greedy generation, streamed: returns tokens, logprobs, the server's
        cached-token metadata, and the client-side time to the first token.
        `extra`: more request fields (e.g. session_id)."""
        body = json.dumps({
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            "return_logprob": True,
            "stream": True,
            **(extra or {}),
        }).encode()
        req = urllib.request.Request(self.base + "/generate", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        ttft = None
        last = None
        try:
            with urllib.request.urlopen(req, timeout=600) as f:
                for raw in f:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        break
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    last = json.loads(payload)
        except (urllib.error.URLError, ConnectionError) as e:
            if not self.alive():
                raise ServerError(f"server died; log {self.log_path}:\n{self.log_tail()}") from e
            raise
        wall = time.perf_counter() - t0
        if last is None:
            raise ServerError("empty streamed response")
        return Generation.from_response(last, len(input_ids), wall, ttft if ttft is not None else wall)

    def post_json(self, path: str, body: Any = None, timeout: float = 300.0) -> Any:
        """POST a JSON body, return the decoded JSON answer (or the raw text)."""
        raw = self._request("POST", path, body if body is not None else {}, timeout)
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def flush_cache(self) -> None:
        """POST /flush_cache (HTTP 200 = flushed; 400 = refused, e.g. requests in
        flight: retried for a while)."""
        last = ""
        for _ in range(100):
            try:
                self._request("POST", "/flush_cache")
                return
            except urllib.error.HTTPError as e:
                last = e.read().decode(errors="replace")
                time.sleep(0.2)
        raise ServerError(f"/flush_cache kept refusing: {last}")


@dataclass
class Generation:
    prompt_tokens: int
    output_ids: list[int]
    logprobs: list[float]
    cached_tokens: int
    cached_device: int
    cached_host: int
    cached_storage: int
    e2e_latency_s: float
    wall_s: float
    ttft_s: float
    meta: dict

    @classmethod
    def from_response(cls, out: dict, prompt_len: int, wall: float, ttft: float) -> "Generation":
        meta = out["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return cls(
            prompt_tokens=int(meta.get("prompt_tokens", prompt_len)),
            output_ids=list(out.get("output_ids") or []),
            logprobs=[x[0] for x in meta.get("output_token_logprobs") or []],
            cached_tokens=int(meta.get("cached_tokens") or 0),
            cached_device=int(details.get("device", 0) or 0),
            cached_host=int(details.get("host", 0) or 0),
            cached_storage=int(details.get("storage", 0) or 0),
            e2e_latency_s=float(meta.get("e2e_latency") or wall),
            wall_s=wall,
            ttft_s=ttft,
            meta={k: v for k, v in meta.items()
                  if k not in ("output_token_logprobs", "input_token_logprobs")},
        )

    @property
    def source(self) -> str:
        """Where the reused prefix came from, as the server reports it."""
        parts = []
        if self.cached_device:
            parts.append(f"device {self.cached_device}")
        if self.cached_host:
            parts.append(f"host {self.cached_host}")
        if self.cached_storage:
            parts.append(f"L3 {self.cached_storage}")
        return ", ".join(parts) or "none (computed)"


def prompt(seed: int, n: int, vocab: int = 1000) -> list[int]:
    """A deterministic pseudo-random prompt of `n` token ids (3..vocab+2)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab + 3) for _ in range(n)]
