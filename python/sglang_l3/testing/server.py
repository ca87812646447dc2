"""Start, talk to and stop a real `python -m sglang.launch_server` serving one of
the packaged tiny hybrid models (`ServerConfig.model`: tiny Qwen3-Next by default,
tiny Qwen3.5 multimodal or text-only) or a model directory (used by
`python -m sglang_l3.testing.demo_server` and test/e2e).

Nothing here changes the server's behaviour: it builds the command line (overlap
scheduling on, upstream's default and the user's, unless
`ServerConfig(overlap_schedule=False)`), waits for the server to be ready, sends
HTTP requests with input ids (--skip-tokenizer-init) and reads what the server
reports.

Upstream's test launcher (`sglang.test.test_utils:popen_launch_server`) does not
fit: it starts `sglang serve` and polls `/health_generate`, which runs a
generation through the very cache a test then inspects (cached-token counts,
L3 pages, counters). Readiness is read from the launcher's log line instead;
stopping uses upstream's `sglang.srt.utils:kill_process_tree`.

Every timeout here (start-up, requests) is in seconds on the quiet reference
machine and is stretched by the machine's measured slowdown
(`sglang_l3.testing.speed`): on a loaded box a start-up is slow, not failed.
A start-up that dies says why (`sglang_l3.testing.exits`: upstream's own
clean-up after a child failed, the OOM killer, or a signal from outside).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sglang_l3
from sglang_l3.testing import forked_launcher, native_logs, speed
from sglang_l3.testing.exits import Watch

MODELS_DIR = Path(sglang_l3.__file__).resolve().parent / "models"
# the packaged tiny models (`--load-format dummy`; docs/state-budget.md, "The tiny models"):
#   tiny-qwen3next    Qwen3NextForCausalLM (Gated-DeltaNet hybrid, MoE)
#   tiny-qwen35       Qwen3_5ForConditionalGeneration (the user's architecture: hybrid text
#                     backbone with Qwen3.5-27B's ratios + vision tower; tokenizer, processors)
#   tiny-qwen35-text  Qwen3_5ForCausalLM (text-only Qwen3.5; tokenizer)
PACKAGED_MODELS = ("tiny-qwen3next", "tiny-qwen35", "tiny-qwen35-text")
DEFAULT_MODEL = "tiny-qwen3next"
TINY_MODEL_DIR = MODELS_DIR / DEFAULT_MODEL
READY_LINE = "The server is fired up"
BIND_ERROR = "error while attempting to bind on address"
# A scheduler's torch.distributed TCPStore could not bind the port the launcher chose
# (`get_free_port_below_ephemeral`: checked free at argument parsing, bound by the
# child some seconds later; another server starting beside it can take it meanwhile).
DIST_BIND_ERROR = "The server socket has failed to listen on any local network address"
# start-up refusals that a shared machine's free memory explains (patch startup-checks;
# upstream's own message where the check does not apply)
LOW_HOST_MEMORY = (
    "less than HiCache's fixed",
    "no host memory is left for HiCache",
    "Not enough host memory available",
    "No host memory is left for HiCache",
)
MEMORY_WAIT_S = 600.0
# upstream's switches for the py-spy dump and CUDA coredump it takes before a crash exit
# (sglang/srt/environ.py; TokenizerManager.dump_requests_before_crash sleeps 5 s first)
CRASH_DIAGNOSTICS = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")
CRASH_DIAGNOSTICS_LINE = "before crash diagnostics"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm_hicache_hash_extension() -> None:
    """Build (once per machine) the C++ page-hash extension HiCache loads lazily.

    Upstream compiles it on first use inside the storage prefetch thread
    (mem_cache/cpp_utils/native_hash.py); on a slow or busy machine that takes
    longer than the 10 s `/flush_cache` waits for the thread to stop
    (HiCacheController._stop_storage_threads), and the scheduler dies with "Failed to stop
    HiCache storage threads cleanly". Building it beforehand avoids that.
    """
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    from sglang_l3.patches import framework

    # this process is no SGLang process (no plugin): apply just the patch that
    # keeps torch's lock file from being reported as stale
    for spec in framework.load_series():
        if spec.id == "quiet-extension-lock":
            framework.apply_one(spec)
    _load_native_hash_module()


def model_dir(model: str | os.PathLike) -> Path:
    """A packaged model name (PACKAGED_MODELS) -> its directory; anything else is a
    path to a model directory (a ServerError when it has no config.json)."""
    if str(model) in PACKAGED_MODELS:
        return MODELS_DIR / str(model)
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ServerError(
            f"model {str(model)!r} is neither a packaged model ({', '.join(PACKAGED_MODELS)}) "
            "nor a directory with a config.json"
        )
    return path


def text_config(model: str | os.PathLike) -> dict[str, Any]:
    """The model's text-backbone config.json fields (`text_config` of a multimodal
    config, else the config itself): vocab_size, layer geometry."""
    cfg = json.loads((model_dir(model) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def omp_threads_bind(ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` CPU ranks: this process's cores split
    into contiguous ranges, one per rank ("0|1" on two cores); with fewer cores than
    ranks, ranks share them."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    parts = []
    for r in range(ranks):
        lo, hi = r * len(cores) // ranks, (r + 1) * len(cores) // ranks
        mine = cores[lo:hi] or [cores[r % len(cores)]]
        contiguous = mine == list(range(mine[0], mine[-1] + 1))
        parts.append(f"{mine[0]}-{mine[-1]}" if contiguous and len(mine) > 1 else ",".join(str(c) for c in mine))
    return "|".join(parts)


@dataclass
class ServerConfig:
    """What the CPU L3 server is started with (defaults: the demo/e2e settings).

    `model`: a packaged model name — "tiny-qwen3next" (default), "tiny-qwen35"
    (`Qwen3_5ForConditionalGeneration`, multimodal), "tiny-qwen35-text"
    (`Qwen3_5ForCausalLM`) — or a path to a model directory; served with
    `--load-format dummy` (seeded per-parameter weights for the packaged ones).
    `skip_tokenizer_init`: requests carry input ids (the default); False loads the
    model's tokenizer (and processor) so text, chat and images can be sent."""

    model: str = DEFAULT_MODEL
    skip_tokenizer_init: bool = True
    storage_dir: str | None = None  # None (and backend "file"): no HiCache at all
    # --hicache-storage-backend; "mooncake" joins the store named by storage_extra_config
    # (e.g. sglang_l3.testing.mooncake.MooncakeCluster.extra_config()), no storage_dir needed
    storage_backend: str = "file"
    storage_extra_config: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    max_total_tokens: int | None = 4096  # None: leave --max-total-tokens to upstream
    max_mamba_cache_size: int = 32
    max_running_requests: int = 8
    chunked_prefill_size: int | None = None
    page_size: int | None = None
    prefetch_threshold: int | None = None
    tp_size: int = 1  # --tp-size; on CPU each rank is a process (gloo, patch cpu-tp-gloo)
    # --sleep-on-idle: an idle scheduler waits in zmq poll (upstream's IdleSleeper, woken at
    # once by a request, else every second) instead of busy-polling a core; False: busy loop.
    # No test server needs the busy loop: the sleeper never sleeps while an L3 transfer or a
    # hint is in flight (test/e2e/test_idle_server.py); False is for benchmark/idle_cpu.py and
    # that test's negative control only.
    sleep_on_idle: bool = True
    # upstream's default, as the user serves; False passes --disable-overlap-schedule
    overlap_schedule: bool = True
    # Upstream's crash diagnostics (SGLANG_PYSPY_DUMP_BEFORE_CRASH,
    # SGLANG_CUDA_COREDUMP_BEFORE_CRASH, both on by default) also run when the harness
    # stops a server: the group's SIGTERM ends a scheduler, the launcher takes that for a
    # crash and sleeps 5 s "to let GPU activity settle" before looking for py-spy. Off
    # unless asked (a variable set in this process's environment wins): every stop in
    # the suite paid those 5 s, and there is no py-spy here. True keeps upstream's.
    crash_diagnostics: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def hicache(self) -> bool:
        return self.storage_dir is not None or self.storage_backend != "file"

    def server_env(self) -> dict[str, str]:
        """Environment the server needs for this config (`env` overrides it)."""
        out: dict[str, str] = {}
        if not self.crash_diagnostics:
            for name in CRASH_DIAGNOSTICS:
                if name not in os.environ:
                    out[name] = "0"
        if self.device == "cpu" and self.tp_size > 1:
            # numa_utils.init_threads_binding asserts ranks <= NUMA nodes unless this
            # names each rank's cores ('|'-separated); without AMX/arm64 sgl-kernel
            # the ids are only logged (distributed/bootstrap.py _init_cpu_threads_env).
            out["SGLANG_CPU_OMP_THREADS_BIND"] = omp_threads_bind(self.tp_size)
        return out

    def args(self, port: int) -> list[str]:
        a = [
            "--model-path",
            str(model_dir(self.model)),
            "--load-format",
            "dummy",
            *(["--skip-tokenizer-init"] if self.skip_tokenizer_init else []),
            "--device",
            self.device,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-running-requests",
            str(self.max_running_requests),
            "--max-mamba-cache-size",
            str(self.max_mamba_cache_size),
            "--mamba-radix-cache-strategy",
            "extra_buffer",
        ]
        if self.sleep_on_idle:
            a.append("--sleep-on-idle")
        if not self.overlap_schedule:
            a.append("--disable-overlap-schedule")
        if self.max_total_tokens is not None:
            a += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.device == "cpu":
            a += ["--attention-backend", "torch_native", "--disable-cuda-graph"]
        else:
            # a tiny model on a big GPU: Triton attention (no FlashInfer needed), a
            # small static fraction (the pools are capped by the token counts above)
            a += ["--attention-backend", "triton", "--mem-fraction-static", "0.2"]
        if self.tp_size != 1:
            a += ["--tp-size", str(self.tp_size)]
        if self.chunked_prefill_size is not None:
            a += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.page_size is not None:
            a += ["--page-size", str(self.page_size)]
        if self.hicache:
            a += [
                "--enable-hierarchical-cache",
                "--hicache-storage-backend",
                self.storage_backend,
                "--hicache-mem-layout",
                "buffer_only",
                # explicit: upstream's auto-sizing refuses to start when the host has
                # less than 10 GiB free (hicache_auto_size.py), as on a busy test box
                "--hicache-ratio",
                "2",
            ]
            # the store location on the command line (not in the environment), so
            # the printed command can be copied as is
            extra: dict[str, Any] = dict(self.storage_extra_config)
            if self.storage_dir is not None:
                extra["store_dir"] = str(self.storage_dir)
            if self.prefetch_threshold is not None:
                extra["prefetch_threshold"] = self.prefetch_threshold
            if extra:
                a += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
        return a + list(self.extra_args)


class ServerError(RuntimeError):
    pass


class _PortTaken(ServerError):
    pass


def _dist_port_taken(log: str) -> bool:
    """A start-up that failed because another process took the port a scheduler's
    TCPStore was to listen on (retried on other ports, as a taken HTTP port is)."""
    return DIST_BIND_ERROR in log and "EADDRINUSE" in log


class Server:
    """One server process on a free loopback port; a context manager."""

    def __init__(
        self,
        config: ServerConfig,
        log_path: str | os.PathLike,
        *,
        startup_timeout: float = 300.0,
        python: str = sys.executable,
    ):
        self.config = config
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.python = python
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | forked_launcher.ForkedLauncher | None = None
        self._watch: Watch | None = None

    # ------------------------------------------------------------- lifecycle
    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", *self.config.args(self.port)]

    def shell_command(self) -> str:
        """The command as one copyable shell line, with the SGLANG* variables
        this launcher sets for the server in front."""
        env = self.env()
        prefix = [
            f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k.startswith("SGLANG") and os.environ.get(k) != v
        ]
        return " ".join(prefix + [shlex.quote(a) for a in self.command])

    def env(self) -> dict[str, str]:
        """The server's environment (the store directory is on the command line
        and created, 0700, by the store itself)."""
        # a test process's own native-log routing stays out: the server's native
        # lines go to its log file with everything else
        env = native_logs.child_env(dict(os.environ))
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.config.device == "cpu":
            # the CPU patches (cpu-serving, cpu-host-pools) apply only when asked
            env["SGLANG_L3_CPU_SERVING"] = "1"
        env.update(self.config.server_env())
        env.update(self.config.env)
        return env

    def start(self, progress: Callable[[float], None] | None = None, progress_every: float = 10.0) -> Server:
        """Launch and wait until ready; `progress(elapsed_s)` is called every
        `progress_every` seconds meanwhile (the demo prints a line).

        free_port() reserves nothing: the server's own scheduler (gloo, Mooncake's
        transfer engine) may bind that ephemeral port before the HTTP server does;
        and the port upstream picks for a scheduler's TCPStore may be taken by a
        server starting beside it before the scheduler binds it. Then start again
        (on another HTTP port; upstream picks its ports afresh), three tries in all.

        HiCache refuses to start while the machine has less host memory available
        than upstream's fixed 10 GiB reserve (patch startup-checks says so at once);
        on a shared test machine that passes: retry every 20 s for up to
        MEMORY_WAIT_S (reference seconds, scaled)."""
        port_tries = 0
        memory_deadline = None
        while True:
            try:
                return self._start_once(progress, progress_every)
            except _PortTaken:
                port_tries += 1
                if port_tries >= 3:
                    raise ServerError(
                        f"a port the server chose was taken three times; log {self.log_path}:\n{self.log_tail()}"
                    ) from None
                self.port = free_port()
                self.base = f"http://127.0.0.1:{self.port}"
            except ServerError as e:
                if not any(m in str(e) for m in LOW_HOST_MEMORY):
                    raise
                if memory_deadline is None:
                    memory_deadline = time.monotonic() + speed.scaled(MEMORY_WAIT_S)
                if time.monotonic() > memory_deadline:
                    raise ServerError(
                        f"host memory stayed below HiCache's reserve for {MEMORY_WAIT_S:.0f} s: {e}"
                    ) from e
                time.sleep(20)

    def forks_launcher(self) -> bool:
        """Whether start() forks the launcher from the worker's fork server
        (SGLANG_L3_TEST_FORK_LAUNCHER=1) instead of running the command line: CPU
        servers only. A GPU server's launcher asks CUDA (memory, devices), and CUDA
        cannot be initialised again in a child forked from a process whose upstream
        imports may have initialised it."""
        return forked_launcher.enabled() and self.python == sys.executable and self.config.device == "cpu"

    def _start_once(self, progress: Callable[[float], None] | None, progress_every: float) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.forks_launcher():
            # the test suite's launcher fork server: the same launcher, its imports paid once
            self.log_path.write_bytes(b"")
            self.proc = forked_launcher.ForkedLauncher(self.python, self.command[3:], self.env(), str(self.log_path))
        else:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    self.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env(),
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        self._watch = Watch(self.proc.pid)
        self._wait_ready(progress, progress_every)
        return self

    def run_to_exit(self, timeout: float = 300.0) -> tuple[int, str, float]:
        """Launch and wait for the launcher to exit by itself (start-up error
        tests): (return code, its output, seconds). The group is killed after."""
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            out, _ = self.proc.communicate(timeout=speed.scaled(timeout))
            code = self.proc.returncode
        except subprocess.TimeoutExpired:
            out, code = b"", -1
        elapsed = time.monotonic() - t0
        self.stop()
        return code, out.decode(errors="replace"), elapsed

    def _wait_ready(self, progress: Callable[[float], None] | None = None, every: float = 5.0) -> None:
        t0 = time.monotonic()
        budget = speed.Budget(self.startup_timeout)
        next_report = t0 + every
        next_sample = t0
        while not budget.expired():
            if progress is not None and time.monotonic() >= next_report:
                progress(time.monotonic() - t0)
                next_report += every
            if time.monotonic() >= next_sample and self._watch is not None:
                self._watch.sample()
                next_sample = time.monotonic() + 2.0
            if self.proc.poll() is not None:
                if _dist_port_taken(self.log_text()):
                    self.stop()
                    raise _PortTaken(self.port)
                code = self.proc.returncode
                cause = self._watch.cause(code, self.log_text()) if self._watch else f"exit code {code}"
                self.stop()
                raise ServerError(
                    f"server exited with {code} during start-up after {budget.describe()}: {cause}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            text = self.log_text()
            if READY_LINE in text:
                return
            if (BIND_ERROR in text and f"'127.0.0.1', {self.port})" in text) or _dist_port_taken(text):
                self.stop()
                raise _PortTaken(self.port)
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"server not ready after {budget.describe()}; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        p, self.proc = self.proc, None
        if p is not None:
            if self._watch is not None:
                self._watch.stopped_by_harness = True
            stop_process_group(p, timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def processes(self) -> list:
        """The server's live processes (psutil): the launcher and everything below it
        (tokenizer, scheduler ranks, detokenizer)."""
        import psutil

        if self.proc is None:
            raise ServerError("server not started")
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def cpu_seconds(self) -> float:
        """User + system CPU seconds used so far by the server's live processes
        (`processes()`), all threads. The difference over a window is the server's
        CPU in it."""
        import psutil

        total = 0.0
        for p in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def __enter__(self) -> Server:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        return self.start()

    def __exit__(self, *exc: object) -> None:
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
            self.base + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=speed.scaled(timeout)) as f:
                return f.read()
        except (urllib.error.URLError, ConnectionError) as e:
            if not self.alive():
                raise ServerError(f"server died; log {self.log_path}:\n{self.log_tail()}") from e
            raise

    def get_text(self, path: str, timeout: float = 60.0) -> str:
        """GET `path` (e.g. "/metrics" when started with --enable-metrics)."""
        return self._request("GET", path, timeout=timeout).decode()

    def generate(
        self,
        input_ids: list[int],
        max_new_tokens: int = 8,
        *,
        timeout: float = 600.0,
        rid: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Generation:
        """Greedy generation, streamed: returns tokens, logprobs, the server's
        cached-token metadata, and the client-side time to the first token.
        `timeout` bounds each socket wait (a hung server raises, never stalls),
        in reference-machine seconds (scaled by the measured slowdown).
        `extra`: more request fields (e.g. session_id)."""
        req_body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            "return_logprob": True,
            "stream": True,
        }
        req_body.update(extra or {})
        if rid is not None:
            req_body["rid"] = rid
        body = json.dumps(req_body).encode()
        req = urllib.request.Request(
            self.base + "/generate", data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        ttft = None
        last = None
        try:
            with urllib.request.urlopen(req, timeout=speed.scaled(timeout)) as f:
                for raw in f:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:") :].strip()
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

    def post(self, path: str, body: Any, timeout: float = 300.0) -> tuple[int, Any]:
        """POST a JSON body; (HTTP status, decoded JSON or text) for any status."""
        try:
            raw, status = self._request("POST", path, body, timeout=timeout), 200
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def flush_cache(self, timeout: float = 300.0) -> list[str]:
        """POST /flush_cache (HTTP 200 = flushed; 400 = refused, e.g. requests in
        flight or L3 writes not yet acked: retried for a while). `timeout` bounds each
        attempt. Returns the refusals that came before the flush."""
        refused: list[str] = []
        last = ""
        for _ in range(100):
            try:
                self._request("POST", "/flush_cache", timeout=timeout)
                return refused
            except urllib.error.HTTPError as e:
                last = e.read().decode(errors="replace")
                refused.append(last)
                time.sleep(0.2)
        raise ServerError(f"/flush_cache kept refusing: {last}")

    def abort(self, rid: str | None = None, timeout: float = 60.0) -> None:
        """POST /abort_request for one request id (None: every request)."""
        body = {"rid": rid or "", "abort_all": rid is None}
        self._request("POST", "/abort_request", body, timeout=timeout)


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
    def from_response(cls, out: dict, prompt_len: int, wall: float, ttft: float) -> Generation:
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
            meta={k: v for k, v in meta.items() if k not in ("output_token_logprobs", "input_token_logprobs")},
        )

    def logprob_difference(self, other: Generation) -> str:
        """'' when both answers' log-probabilities are equal bit for bit; else how many
        positions differ, the largest difference and the first positions (for a
        failure message: an ulp off says numerics, a large one says another prefix)."""
        if len(self.logprobs) != len(other.logprobs):
            return f"{len(self.logprobs)} log-probabilities against {len(other.logprobs)}"
        diffs = [(i, x, y) for i, (x, y) in enumerate(zip(self.logprobs, other.logprobs, strict=True)) if x != y]
        if not diffs:
            return ""
        worst = max(abs(x - y) for _, x, y in diffs)
        first = ", ".join(f"#{i} {x!r} vs {y!r}" for i, x, y in diffs[:3])
        return f"{len(diffs)} of {len(self.logprobs)} positions, largest {worst:.3g}; {first}"

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


def stop_process_group(p: subprocess.Popen | forked_launcher.ForkedLauncher, timeout: float = 30.0) -> None:
    """Stop a child started in a session of its own: SIGTERM its process group so
    it shuts down cleanly; after `timeout`, upstream's kill_process_tree kills and
    reaps what is left, and the group is killed for any process that left the tree."""
    from sglang.srt.utils import kill_process_tree

    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout)
    if p.poll() is None:  # still ours (a reaped pid may already be someone else's)
        with contextlib.suppress(RuntimeError):  # not reaped in time: the group kill follows
            kill_process_tree(p.pid, include_parent=True, wait_timeout=30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(10)
