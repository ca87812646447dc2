"""Run a named test suite (upstream SGLang style: `python test/run_suite.py --suite cpu`).

Suites:
  cpu       everything that runs without a GPU (default; `make test`, CI), the
            real Hermes agents included (they skip, saying why, without .venv-hermes)
  fast      unit + integration, no GPU, nothing marked slow or aot (`make test-fast`)
  upstream  SGLang's own unified-radix-cache kits composed over every config,
            with every sglang-l3 patch applied
  gpu       GPU checks (CUDA or ROCm); skip cleanly without a GPU
  rdna3     RDNA3-only checks (gfx11xx); skip cleanly elsewhere
  agents    only the real hermes-agent processes against a CPU server (`make test-agents`)

cpu and fast run on two pytest-xdist workers (`--jobs`; 1 = one process, in
order): a test file that shares servers or state is one group, run in file order
on one worker (test/conftest.py: xdist_group), and the slowest files start first.
Each process of a parallel run (the workers and the CPU servers they start) computes
on one OpenMP thread (OMP_NUM_THREADS=1 unless set): with torch's default of one
thread per core, two workers' servers ran four or more compute threads on two cores,
and their spinning threads took turns from each other's work.
The total time is printed at the end; a run with failures or without any test
exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

SUITES: dict[str, list[str]] = {
    "cpu": ["unit", "integration", "upstream", "e2e", "agents", "-m", "not gpu and not rdna3"],
    "fast": ["unit", "integration", "-m", "not gpu and not rdna3 and not slow and not aot"],
    "upstream": ["upstream"],
    "gpu": ["unit", "integration", "e2e", "gpu", "-m", "gpu"],
    "rdna3": ["unit", "gpu", "-m", "rdna3"],
    "agents": ["agents", "-m", "agents"],
}
# suites run by two pytest-xdist workers unless --jobs 1 (GPU suites share the devices)
PARALLEL = ("cpu", "fast")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="cpu", choices=sorted(SUITES))
    ap.add_argument(
        "--without-patches",
        action="store_true",
        help="negative control: SGLANG_L3_DISABLE every patch except the CPU support groups",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="pytest-xdist workers for the cpu and fast suites (default: 2 on a machine with 2+ cores; "
        "1 = one process, in order)",
    )
    ap.add_argument("pytest_args", nargs="*", help="extra arguments passed to pytest (after --)")
    args = ap.parse_args()
    targets = SUITES[args.suite]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", HERE]
    jobs = args.jobs if args.jobs is not None else (2 if (os.cpu_count() or 1) >= 2 else 1)
    if args.suite in PARALLEL and jobs > 1:
        # Test files that share servers or state are one xdist group each (test/conftest.py:
        # xdist_group), run in file order on one worker; the slowest files start first.
        cmd += ["-n", str(jobs), "--dist", "loadgroup", "--no-loadscope-reorder"]
    it = iter(targets)
    for t in it:
        if t == "-m":
            cmd += ["-m", next(it)]
        else:
            path = os.path.join(HERE, t)
            if os.path.isdir(path):
                cmd.append(path)
    if args.suite in ("cpu", "fast"):
        cmd.append("--durations=60")  # the 60 slowest tests, after the summary (where the suite's time goes)
    cmd += args.pytest_args
    env = dict(os.environ)
    if args.suite in PARALLEL and jobs > 1:
        # one compute thread per process (see the docstring): measured on the 2-core box,
        # e2e/test_l3_restore_server.py twice side by side took 184 s and 244 s with it,
        # 233 s and 294 s without (2026-12-05). A no-cache reference and the server it is
        # compared with run under the same setting.
        env.setdefault("OMP_NUM_THREADS", "1")
    if args.without_patches:
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
        from sglang_l3.patches.framework import load_series

        # Keep what makes a machine without a GPU able to run SGLang at all.
        infra = {"cpu", "cpu-serving", "tiny-model"}
        env["SGLANG_L3_DISABLE"] = ",".join(s.id for s in load_series() if s.group not in infra)
        print(f"[run_suite] SGLANG_L3_DISABLE={env['SGLANG_L3_DISABLE']}", flush=True)
    omp = f" OMP_NUM_THREADS={env['OMP_NUM_THREADS']}" if "OMP_NUM_THREADS" in env else ""
    print(f"[run_suite] suite={args.suite}{omp}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, cwd=os.path.dirname(HERE), env=env)
    took = time.monotonic() - t0
    print(
        f"[run_suite] suite={args.suite} finished in {took:.0f}s ({took // 60:.0f} min {took % 60:.0f} s) "
        f"with exit code {rc}",
        flush=True,
    )
    if rc == 5:  # pytest: no tests collected — a suite that runs nothing has failed
        print("[run_suite] no tests were collected", flush=True)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
