"""Every `SGLANG_L3_*` environment variable sglang-l3 reads, with its meaning and
default (docs/operations.md, "Environment variables", lists the same). A test
checks that no variable is read without being declared here.

`value(name)` reads a declared variable (its default when unset or empty);
`flag(name)` reads a declared boolean ("1", "true", "yes" are true). Store
settings are read by sglang_l3.storage.config, where an extra-config key of
`--hicache-storage-backend-extra-config` takes precedence over the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # "" = unset
    meaning: str
    scope: str  # "serving" | "store" | "quant" | "tests"


_VARS = (
    # serving process / patch queue
    EnvVar("SGLANG_L3_DISABLE", "", "comma-separated patch ids not to apply (doctor shows them disabled)", "serving"),
    EnvVar(
        "SGLANG_L3_PREDICTED_RETURN",
        "off",
        "percentile of a session's own gaps (answer -> next request) after which its idle context is "
        "staged like a hint (predicted return): on or 1 = 25, a number in (1, 100] (e.g. 40) or pN (e.g. p1, "
        "the 1st); off: never",
        "serving",
    ),
    EnvVar(
        "SGLANG_L3_TOOL_PIN",
        "off",
        "percentile of a session's own gaps (answer -> next request) for which a turn that ends in a "
        "tool call keeps its context on the device (patch tool-pins): on or 1 = 90, a number in (1, 100] "
        "(e.g. 80) or pN (e.g. p1, the 1st); off: never",
        "serving",
    ),
    EnvVar("SGLANG_L3_TOOL_PIN_MAX_S", "300", "the longest a tool-call pin lasts, seconds", "serving"),
    EnvVar(
        "SGLANG_L3_ALLOW_DRIFT",
        "0",
        "1: apply patches whose upstream targets drifted from their fingerprints",
        "serving",
    ),
    EnvVar(
        "SGLANG_L3_STRICT",
        "1",
        "0: a patch that cannot be verified is logged and the server starts unpatched (default: the process exits)",
        "serving",
    ),
    EnvVar(
        "SGLANG_L3_CPU_SERVING",
        "0",
        "1: apply the CPU patches (cpu-host-pools, group cpu-serving) on a "
        "machine without an accelerator; set by sglang_l3.cpu.enable() and the CPU server launcher",
        "serving",
    ),
    EnvVar(
        "SGLANG_L3_VERIFY",
        "0",
        "1: the reanchor patch compares restored Mamba states tensor by tensor at "
        "each load-back ack (forces a device sync), TP ranks compare every restore decision, and the "
        "l3-wait-watchdog recomputes a request stuck waiting on L3 (counter l3_wait_abandoned)",
        "serving",
    ),
    EnvVar(
        "SGLANG_L3_WAIT_MARGIN",
        "30",
        "seconds past its prefetch budget a request may wait on L3 while the scheduler is idle before the "
        "l3-wait-watchdog reports it (one warning, counter l3_wait_overdue; with SGLANG_L3_VERIFY=1 it logs every "
        "rank's state and recomputes it)",
        "serving",
    ),
    EnvVar(
        "SGLANG_L3_PUBLISH_STATS",
        "1",
        "1: a process the plugin loads into publishes its counters for "
        "`sglang-l3 doctor --stats` (the plugin sets 1 unless already set; the test session sets 0)",
        "serving",
    ),
    EnvVar(
        "SGLANG_L3_STATS_DIR",
        "$XDG_CACHE_HOME/sglang-l3/stats (~/.cache/...)",
        "where published counters live",
        "serving",
    ),
    # L3 store (extra-config keys win)
    EnvVar(
        "SGLANG_L3_STORE_DIR",
        "$XDG_CACHE_HOME/sglang-l3/store (~/.cache/...)",
        "store directory (also SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR)",
        "store",
    ),
    EnvVar("SGLANG_L3_STORE_MAX_BYTES", "0", "byte cap of the store, 0 = none (e.g. 200G)", "store"),
    EnvVar("SGLANG_L3_STORE_MIN_FREE_BYTES", "5%", "free-space floor of the filesystem (bytes or %)", "store"),
    EnvVar(
        "SGLANG_L3_STORE_DURABILITY", "none", "none / batch: batch fsyncs written pages and their directory", "store"
    ),
    EnvVar("SGLANG_L3_STORE_ODIRECT", "auto", "auto / on / off: O_DIRECT page IO", "store"),
    EnvVar("SGLANG_L3_STORE_IO_THREADS", "32", "parallel IO threads per store (1..256)", "store"),
    EnvVar("SGLANG_L3_STORE_EVICTION_RATIO", "0.9", "evict down to this fraction of the cap", "store"),
    EnvVar("SGLANG_L3_STORE_MODEL_IDENTITY", "", "override of the model identity pages are keyed by", "store"),
    EnvVar(
        "SGLANG_L3_STREAM_WRITE_WINDOW",
        "0.25",
        "fraction of the host KV pool per streamed write-through window (patch streamed-write)",
        "serving",
    ),
    EnvVar(
        "SGLANG_L3_STREAM_PIECE",
        "0.4",
        "fraction of the host KV pool per streamed restore piece (patch streamed-restore)",
        "serving",
    ),
    # GPTQ on ROCm
    EnvVar("SGLANG_L3_GPTQ_OPS", "", "path of a library with a native gptq_gemm_rdna3 op", "quant"),
    EnvVar("SGLANG_L3_GPTQ_NATIVE", "1", "0: never probe native GPTQ ops", "quant"),
    # test harnesses
    EnvVar(
        "SGLANG_L3_REQUIRE_MOONCAKE",
        "0",
        "1: the Mooncake tests fail instead of skipping when Mooncake is not installed (set by `make test`)",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_E2E_STARTUP_TIMEOUT",
        "420",
        "seconds an e2e test server may take to start (on the quiet reference machine; scaled by the slowdown)",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_E2E_REQUEST_TIMEOUT",
        "180",
        "seconds each HTTP request of the TP=2 e2e tests may take (reference machine; scaled by the slowdown)",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_E2E_TEST_BOUND",
        "600",
        "seconds one TP=2 e2e test may take before it fails (hang guard; reference machine, scaled by the slowdown)",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_TEST_SLOWDOWN",
        "",
        "fixed factor for the test harness's timeouts instead of the measured one (sglang_l3.testing.speed; "
        "1 = no scaling)",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_E2E_TP2_DEVICE", "cpu", "device of the TP=2 e2e servers (cuda on a machine with >= 2 GPUs)", "tests"
    ),
    EnvVar(
        "SGLANG_L3_TEST_DEVICE",
        "cpu",
        "device of the cache stacks the integration tests and benchmarks build (sglang_l3.testing.device): cpu "
        "(CPU pools, the simulated device) or cuda (a CUDA/ROCm GPU: real streams and events, no simulator; "
        "test/gpu/device_check.sh sets it); test faults are honoured there too",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_TEST_FORK_LAUNCHER",
        "0",
        "1: sglang_l3.testing.server.Server starts launchers from a per-process fork server "
        "(sglang_l3.testing.forked_launcher: upstream's launcher imports paid once); test/e2e/conftest.py sets it "
        "for e2e tests unless the environment says 0 (docs/testing.md)",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_TEST_IDLE_BUSY",
        "0",
        "1: test_idle_server starts its L3 server without --sleep-on-idle (the negative control: its sleep checks "
        "must fail)",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_TEST_FAULT",
        "unset",
        "fault injection for tests only: restore-fallback@RANK makes that TP rank alone fall back on its first "
        "restore, to prove SGLANG_L3_VERIFY=1 catches a rank disagreement; skip-load-fence removes the streamed "
        "restore's fence on the forward stream, to prove the simulated-stream tests catch it; stream-hold@PATH makes "
        "streamed restores start no read while PATH exists (at most 120 s), to queue requests behind a stream in "
        "flight; read-hold@PATH blocks a streamed restore's reads past the first K pieces (K: PATH's content) while "
        "PATH exists (at most 120 s), to abort a request with reads in flight; honoured only while the CPU switch or the simulated device is active, or SGLANG_L3_TEST_DEVICE=cuda (sglang_l3.faults), ignored "
        "elsewhere; never set in production",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_SIM_STREAMS",
        "",
        "SEED[:threaded]: with the CPU switch, a simulated asynchronous device (patch cpu-sim-streams): "
        "side-stream copies queue until waited on, acks lag by seeded polls (:threaded: a device thread runs "
        "them); for the cache-stack tests and benchmarks, never for a served model",
        "tests",
    ),
    EnvVar(
        "SGLANG_L3_SCRIPTED_DECODE",
        "",
        "PATH of a JSON script: with the CPU switch, the test server's sampled tokens follow the rule whose "
        "marker its prompt contains (patch scripted-decode), and the model's log-probability of each forced "
        "token is recorded; for tests, never for a served model",
        "tests",
    ),
)

VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}
_TRUE = ("1", "true", "yes")


def value(name: str) -> str:
    """The variable's value, or its declared default when unset or empty."""
    var = VARS[name]  # KeyError: an undeclared variable
    return os.environ.get(name) or var.default


def flag(name: str) -> bool:
    return value(name).strip().lower() in _TRUE
