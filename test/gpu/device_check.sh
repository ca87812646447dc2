#!/usr/bin/env bash
# GPU checks of sglang-l3 on a lent, bare GPU machine (one NVIDIA H200 here;
# Python 3.12 with its own torch/Triton; no package index), the repository
# copied to the current directory. Finishes in < 8 minutes.
# With >= 2 GPUs and a runnable sglang 0.5.23, step 4 also runs the TP=2 server tests.
#
#   bash test/gpu/device_check.sh            # on the GPU machine, from the repo root
#   bash test/gpu/device_check.sh --dry-run  # anywhere: checks the script's logic
#   bash test/gpu/device_check.sh --only cache   # one part: gptq (steps 1-2) or cache (5)
#
# What runs (torch + Triton only; sglang is not needed and not installed):
#   1. the compiled GPTQ Triton kernels against the torch reference
#      (test/gpu/gptq_check.py: 4-bit in every variant, 2/3/8-bit, fp16 + bf16,
#      M in 1/2/3/8/16/40/130 (GEMV, split-K tl.dot, tl.dot tiles), each with its
#      wrong-zero-format negative control; every architecture table's decode configs)
#   2. benchmark/gptq_bench.py for decode shapes M = 1, 2, 4, 8, 16 at K = N =
#      4096 and 8192 and Qwen3.5-27B's per-rank layers at TP=2: the Triton kernel
#      before issue 53 ("old") and the decode path ("new") timed side by side with
#      fp16 dense torch.matmul in the same run, eager and graph-replayed (the
#      "/ dense" columns are the ratios; issue 53's target is judged on them),
#      then --sweep: alternative decode configs, for the per-arch table
#   5. the cache steps (test/gpu/cache_check.sh, issue 52): SGLang from the carried
#      kit (.gpukit/, built here by test/gpu/build_kit.py) unless installed, doctor,
#      the HiCache integration selection on the GPU (SGLANG_L3_TEST_DEVICE=cuda), the
#      fence's negative control, restore_bench --device cuda at 32K and 131K, and
#      agent_switch --device cuda at 131K (issue 50; both at 32K without --only).
# --dry-run runs steps 1-2 on the CPU under the Triton interpreter (small shapes,
# nothing timed): every new kernel and table config checked against the reference;
# and step 5 on the CPU stack (see cache_check.sh). Budgets (seconds, of 450 in all):
# the cache steps DEVICE_CHECK_CACHE_S (170; restore_bench and agent_switch at 32K only,
# 131K with --only cache), the benchmark DEVICE_CHECK_BENCH_S (110), the kernel check the rest;
# with --only, the part run has the whole budget.
# Wheels a step needs beyond the image (none so far) travel in ./.whl (git-ignored)
# and are installed offline into $SITE. Results: $OUT (or /tmp/sglang-l3-device-check):
# device_check.log, env.txt, gptq_check.json, gptq_bench.txt, gptq_bench.json,
# cache_check.log.
# Exit: 0 all good; 1 a kernel mismatch; 2 no GPU; 3 setup failed; 4 out of time.
set -uo pipefail
DRY=0
ONLY=all
while (( $# )); do
    case $1 in
        --dry-run) DRY=1 ;;
        --only) ONLY=${2:-}; shift ;;
        *) echo "device_check.sh: unknown argument $1 (--dry-run, --only gptq|cache)"; exit 3 ;;
    esac
    shift
done
[[ $ONLY == all || $ONLY == gptq || $ONLY == cache ]] || { echo "device_check.sh: --only gptq or cache"; exit 3; }
CACHE_S=0
[[ $ONLY == all ]] && CACHE_S=${DEVICE_CHECK_CACHE_S:-170}
START=$(date +%s)
BUDGET=${DEVICE_CHECK_BUDGET_S:-450}   # < 8 min with margin
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/sglang-l3-site}
OUT_DIR=${OUT:-/tmp/sglang-l3-device-check}
mkdir -p "$OUT_DIR" "$SITE"
exec > >(tee -a "$OUT_DIR/device_check.log") 2>&1
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
say() { echo "[device_check +$(( $(date +%s) - START ))s] $*"; }
# the one source of the upstream pin: sglang_l3.SGLANG_PIN (reported, not needed here)
PIN=$(sed -n 's/^SGLANG_PIN = "\(.*\)"/\1/p' python/sglang_l3/__init__.py)
[[ -n $PIN && -f test/gpu/gptq_check.py && -f benchmark/gptq_bench.py && -f test/gpu/cache_check.sh ]] \
    || { say "run from the repository root"; exit 3; }
export PYTHONPATH="$SITE:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
RC=0

# 0. environment
"$PY" - > "$OUT_DIR/env.txt" 2>&1 <<PYEOF
import platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "hip", torch.version.hip)
    print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
except Exception as e:
    print("torch missing:", e)
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton missing:", e)
print("sglang pin (not needed here)", "$PIN")
PYEOF
cat "$OUT_DIR/env.txt"

# 1. carried wheels (offline), then torch + Triton + a GPU
if compgen -G ".whl/*.whl" >/dev/null; then
    say "installing carried wheels from .whl/ into $SITE"
    if (( DRY )); then say "(dry run: not installing)"
    else "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || { say "wheel install failed"; exit 3; }; fi
fi
"$PY" -c 'import torch, triton' || { say "torch and triton must be importable by $PY"; exit 3; }
if (( ! DRY )) && ! "$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "no GPU visible to $PY's torch: nothing to check"; exit 2
fi

cache_steps() {
    local T=$(( $(left) - 5 ))
    if (( T < 90 )); then say "cache steps skipped: only ${T}s left"; RC=4; return; fi
    say "cache steps: test/gpu/cache_check.sh (limit ${T}s)"
    local ARGS=()
    (( DRY )) && ARGS+=(--dry-run)
    local CONTEXTS=32768,131072 SWITCH=131072 RESERVE=90
    # the budget is shared with the GPTQ steps: 32K rows, the switch at 32K
    [[ $ONLY == all ]] && CONTEXTS=32768 SWITCH=32768 RESERVE=30
    CACHE_CHECK_BUDGET_S=$T OUT_DIR="$OUT_DIR" PYTHON="$PY" CACHE_BENCH_CONTEXTS=${CACHE_BENCH_CONTEXTS:-$CONTEXTS} \
        CACHE_SWITCH_CONTEXT=${CACHE_SWITCH_CONTEXT:-$SWITCH} CACHE_SWITCH_RESERVE_S=${CACHE_SWITCH_RESERVE_S:-$RESERVE} \
        bash test/gpu/cache_check.sh "${ARGS[@]}"
    local CC=$?
    case $CC in
        0) say "cache steps: all passed" ;;
        4) say "cache steps: out of time"; (( RC )) || RC=4 ;;
        3) say "cache steps: setup failed"; (( RC )) || RC=3 ;;
        *) say "cache steps: FAILED (rc=$CC)"; RC=1 ;;
    esac
}
if [[ $ONLY == cache ]]; then
    cache_steps
    (( DRY )) && say "dry run: logic checked (the cache steps on the CPU stack)"
    say "done, rc=$RC (results in $OUT_DIR)"
    exit "$RC"
fi

# 2. the compiled Triton kernels against the reference (most of them compile here);
#    the benchmark keeps BENCH_S, the cache steps CACHE_S
BENCH_S=${DEVICE_CHECK_BENCH_S:-110}
T=$(( $(left) - BENCH_S - CACHE_S ))
say "GPTQ Triton kernels vs reference (limit ${T}s)"
GC_ARGS=(--json "$OUT_DIR/gptq_check.json" --deadline-s $(( T - 20 )))
(( DRY )) && GC_ARGS+=(--dry-run)
timeout --kill-after=10 "$T" "$PY" test/gpu/gptq_check.py "${GC_ARGS[@]}"
GC=$?
case $GC in
    0) say "gptq_check: all match" ;;
    124|137) say "gptq_check: out of time"; RC=4 ;;
    3) say "gptq_check: could not run here (rc=3, said above)"; RC=1 ;;
    *) say "gptq_check: FAILED (rc=$GC)"; RC=1 ;;
esac

# 3. the decode-shape benchmark, ratio to fp16 dense torch.matmul, old and new side by side
T=$(( $(left) - 10 - CACHE_S ))
if (( T < 60 )); then
    say "only ${T}s left: benchmark skipped"; RC=4
else
    say "benchmark/gptq_bench.py, M = 1..16, K = N = 4096/8192 + Qwen3.5-27B TP=2 layers (limit ${T}s)"
    BENCH=(benchmark/gptq_bench.py --ms 1 2 4 8 16 --sizes 4096 8192 --model Qwen3.5-27B --tp 2 --iters 100
           --sweep --sweep-deadline-s $(( T - 20 )) --json "$OUT_DIR/gptq_bench.json")
    (( DRY )) && BENCH+=(--dry-run)
    timeout --kill-after=10 "$T" "$PY" "${BENCH[@]}" 2>&1 | tee "$OUT_DIR/gptq_bench.txt"
    GB=${PIPESTATUS[0]}
    case $GB in
        0) say "gptq_bench: done" ;;
        124|137) say "gptq_bench: out of time"; RC=4 ;;
        3) say "gptq_bench: could not run here (rc=3, said above)"; RC=1 ;;
        *) say "gptq_bench: a kernel did not match the reference (rc=$GB)"; RC=1 ;;
    esac
fi
# 4. TP=2 variants (test/e2e/test_tp2_l3.py on CUDA: P -> flush -> P vs a no-cache
#    TP=2 server, asymmetric damage to one rank's pages, write failure, abort,
#    restart, verify mode catching an injected rank disagreement). Needs >= 2 GPUs
#    and sglang 0.5.23 with its GPU runtime (carried in .whl/); skipped cleanly else.
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if (( DRY )); then
    say "dry run: TP=2 variants would need >= 2 GPUs (${NGPU} visible) and sglang $PIN"
elif (( NGPU < 2 )); then
    say "TP=2 variants skipped: ${NGPU} GPU(s) visible, TP=2 needs 2"
elif ! "$PY" -c "import sglang, sys; sys.exit(0 if sglang.__version__ == '$PIN' else 1)" 2>/dev/null; then
    say "TP=2 variants skipped: sglang $PIN is not importable here (carry it in .whl/)"
else
    T=$(( $(left) - 10 - CACHE_S ))
    if (( T < 180 )); then
        say "TP=2 variants skipped: only ${T}s left"
    else
        say "running the TP=2 variants on ${NGPU} GPUs (limit ${T}s)"
        SGLANG_L3_E2E_TP2_DEVICE=cuda SGLANG_L3_E2E_STARTUP_TIMEOUT=$(( T / 5 )) \
            timeout --kill-after=20 "$T" "$PY" -m pytest -q -p no:cacheprovider \
            test/e2e/test_tp2_l3.py --basetemp "$OUT_DIR/pytest-tp2" -rA 2>&1 \
            | tee "$OUT_DIR/pytest-tp2.log"
        RC2=${PIPESTATUS[0]}
        (( RC == 0 )) && RC=$RC2
    fi
fi
# 5. the cache steps
[[ $ONLY == all ]] && cache_steps
(( DRY )) && say "dry run: logic checked (kernels run by the Triton interpreter on the CPU, nothing timed)"
say "done, rc=$RC (results in $OUT_DIR)"
exit "$RC"
