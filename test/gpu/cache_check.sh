#!/usr/bin/env bash
# The cache steps of the device check (issue 52): HiCache's data path on a real GPU.
# Called by device_check.sh (its budget, its log); alone, from the repo root:
#
#   bash test/gpu/cache_check.sh            # on the GPU machine
#   bash test/gpu/cache_check.sh --dry-run  # anywhere: the same steps on the CPU stack
#
# 1. SGLang: importable as installed, or from the carried kit (.gpukit/site.tar.xz,
#    built here by `python test/gpu/build_kit.py`: SGLang's tree for the pin, the
#    wheels the GPU image lacks, a test-only sgl_kernel shim binding the direct KV
#    transfer ops; checked against its manifest, unpacked to $KIT_SITE).
# 2. `sglang-l3 doctor` there (the tree core against that torch, every patch's state).
# 3. The integration selection that moves data through HiCache (streamed restore,
#    fences, damage fallback, bursts, abort, re-anchor, write path) with
#    SGLANG_L3_TEST_DEVICE=cuda: device pools on the GPU, upstream's load/write
#    streams and events real, no simulator (its own tests skip, saying so); -n
#    $CACHE_WORKERS processes.
# 4. The fence's negative control on the same device: the test that races a forward in
#    flight (its stream kept busy ~0.5 s on a GPU) against the streamed restore's piece
#    copies, with SGLANG_L3_TEST_FAULT=skip-load-fence: it must fail, reported either way.
# 5. benchmark/restore_bench.py --device cuda at CACHE_BENCH_CONTEXTS (default 32K and
#    131K; device_check.sh without --only passes 32K: its budget is shared) for
#    Qwen3.5-27B, one TP=2 rank: restore vs the store's own read and the raw disk,
#    exactness, and the GPU's bulk pinned host->device rate (h2d_GB/s).
# 6. benchmark/agent_switch.py --device cuda at CACHE_SWITCH_CONTEXT (default 131K;
#    device_check.sh without --only passes 32K) with 4 switches, when at least
#    CACHE_SWITCH_MIN_S (45) seconds are left (step 5 leaves it CACHE_SWITCH_RESERVE_S,
#    90, where both fit): two agents over one device pool, the
#    arriving context streamed back while the resident's newest turn is written
#    (issue 50's switch_vs_store and write_wait_ms); every switch exact, every turn in L3.
# --dry-run: the same steps on the CPU stack (SGLANG_L3_TEST_DEVICE=cpu, the simulated
# device); the selection and the fence control are collected, not run, unless
# CACHE_DRY_RUN_TESTS=1; restore_bench runs at 8K, one buffer; agent_switch at 1,024
# tokens, two switches. With the kit (a Python
# without sglang, e.g. PYTHON=<3.12 venv with torch 2.11>), the dry run also imports
# every module the unit and integration tests load with SGLang's is_cuda() forced
# (test/gpu/kit_check.py: the shim's branches, which the GPU takes for real).
# Everything goes to stdout and $OUT_DIR/cache_check.log. Exit: 0 all passed; 1 a
# test or the benchmark failed; 3 setup failed; 4 out of time.
set -uo pipefail
DRY=0
[[ ${1:-} == --dry-run ]] && DRY=1
START=$(date +%s)
BUDGET=${CACHE_CHECK_BUDGET_S:-210}
PY=${PYTHON:-python3}
OUT_DIR=${OUT_DIR:-${OUT:-/tmp/sglang-l3-device-check}}
KIT=${KIT:-.gpukit}
KIT_SITE=${KIT_SITE:-/tmp/sglang-l3-kit}
WORK=${CACHE_WORK:-/tmp/sglang-l3-cache-check}
WORKERS=${CACHE_WORKERS:-12}
mkdir -p "$OUT_DIR" "$WORK"
exec > >(tee -a "$OUT_DIR/cache_check.log") 2>&1
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
say() { echo "[cache_check +$(( $(date +%s) - START ))s] $*"; }
[[ -f test/gpu/build_kit.py && -f benchmark/restore_bench.py ]] || { say "run from the repository root"; exit 3; }
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$WORK/torch_extensions}
RC=0

# 1. SGLang: installed, or the carried kit (the dry run builds a missing or stale one
#    with the repository's venv, which has what the builder reads)
KIT_BUILDER=${KIT_BUILDER:-.venv/bin/python}
INSTALLED=0  # asked once: importing sglang takes seconds
"$PY" -c 'import sglang' 2>/dev/null && INSTALLED=1
if (( DRY && ! INSTALLED )) && [[ -x $KIT_BUILDER ]] \
    && ! "$KIT_BUILDER" test/gpu/build_kit.py --check-only --out "$KIT" >/dev/null 2>&1; then
    say "dry run: building the kit into $KIT ($KIT_BUILDER test/gpu/build_kit.py)"
    "$KIT_BUILDER" test/gpu/build_kit.py --out "$KIT" || { say "building the kit FAILED"; exit 3; }
fi
if (( INSTALLED )); then
    say "sglang importable as installed: no kit needed"
elif [[ -f $KIT/site.tar.xz ]]; then
    say "unpacking the kit $KIT into $KIT_SITE"
    "$PY" test/gpu/build_kit.py --check-only --out "$KIT" || { say "the kit does not match its manifest"; exit 3; }
    # its wheels are for one Python X.Y (the manifest's): another interpreter cannot load them
    WANT=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["python"])' "$KIT/manifest.json")
    HAVE=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [[ $WANT == "$HAVE" ]] || { say "the kit is for Python $WANT, $PY is $HAVE: rebuild it with test/gpu/build_kit.py --python-version $HAVE"; exit 3; }
    rm -rf "$KIT_SITE" && mkdir -p "$KIT_SITE" && tar -xJf "$KIT/site.tar.xz" -C "$KIT_SITE" \
        || { say "cannot unpack the kit"; exit 3; }
    export PYTHONPATH="$KIT_SITE/site:$PYTHONPATH"
    "$PY" -c 'import sglang' || { say "sglang does not import from the kit"; exit 3; }
    # the kit's pytest-xdist only where the image has none (last on the path: never shadows)
    if ! "$PY" -c 'import xdist' 2>/dev/null && [[ -d $KIT_SITE/runner ]]; then
        export PYTHONPATH="$PYTHONPATH:$KIT_SITE/runner"
        say "pytest-xdist from the kit's runner/: $PY has none"
    fi
    "$PY" -c 'import torch, torchvision' 2>/dev/null \
        || say "warning: the kit's torchvision (built for torch 2.11) does not import with this torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
    if (( DRY )); then
        say "kit: recording the modules the unit and integration tests import, then importing them with is_cuda() forced"
        "$PY" test/gpu/kit_check.py --record "$WORK/closure.txt" --paths test/integration test/unit > "$WORK/record.log" 2>&1 \
            || { tail -n 5 "$WORK/record.log"; say "kit: recording the closure FAILED"; exit 3; }
        "$PY" test/gpu/kit_check.py --closure "$WORK/closure.txt" --force-cuda 2>&1 | grep -v "Warning\|warnings.warn"
        (( PIPESTATUS[0] == 0 )) || { say "kit: the closure does not import with is_cuda() forced"; RC=1; }
    fi
else
    say "sglang is not importable and there is no kit ($KIT/site.tar.xz): build it with test/gpu/build_kit.py"
    exit 3
fi
if (( DRY )); then
    export SGLANG_L3_TEST_DEVICE=cpu
else
    export SGLANG_L3_TEST_DEVICE=cuda
fi
# The Rust tree core is compiled against the torch sglang pins; elsewhere the Python one runs.
if "$PY" -c 'import sys; from sglang_l3.tree_core import rust_core_mismatch as m; w = m(); print(w or ""); sys.exit(1 if w else 0)'; then
    :
else
    export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
    say "tree core: python (SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python)"
fi

# 2. doctor
say "sglang-l3 doctor (SGLANG_L3_TEST_DEVICE=$SGLANG_L3_TEST_DEVICE)"
"$PY" -c 'import sys; from sglang_l3 import cli; sys.exit(cli.main(["doctor"]))' 2>&1 | grep -v "UserWarning\|warnings.warn"

# 3. the integration selection
SELECTION=(
    test/integration/test_l3_restore.py
    test/integration/test_streamed_restore.py
    test/integration/test_streamed_restore_short.py
    test/integration/test_streamed_restore_burst.py
    test/integration/test_streamed_restore_evict.py
    test/integration/test_damage_fallback.py
    test/integration/test_abort_idle_check.py
    test/integration/test_store_restore.py
    test/integration/test_reanchor.py
    test/integration/test_stream_fitting_hits.py
    test/integration/test_streamed_write.py
    test/integration/test_streamed_restore_async.py
)
# the test that races a forward in flight (kept busy on the GPU) against the streamed
# restore's piece copies; upstream's own load-back fence has its control in the selection
# (test_l3_restore.py::test_a_forward_in_flight_lands_before_the_load_back[False])
FENCE=("test/integration/test_streamed_restore_async.py::test_a_forward_in_flight_lands_before_the_piece_copy")
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfE)
RUN_TESTS=$(( ! DRY || ${CACHE_DRY_RUN_TESTS:-0} ))
if (( RUN_TESTS )); then
    (( DRY )) && WORKERS=${CACHE_WORKERS_DRY:-2}
    # without pytest-xdist (neither the image's nor the kit's runner/): one process, said
    # so, rather than a usage error that runs nothing
    XDIST=(-n "$WORKERS")
    if ! "$PY" -c 'import xdist' 2>/dev/null; then
        say "pytest-xdist is not importable by $PY: the selection and the fence control run in one process"
        XDIST=()
        WORKERS=1
    fi
    T=$(( $(left) - 100 ))
    if (( T < 60 )); then say "only ${T}s left for the selection"; exit 4; fi
    say "integration selection on $SGLANG_L3_TEST_DEVICE, -n $WORKERS (limit ${T}s)"
    timeout --kill-after=15 "$T" "${PYTEST[@]}" "${XDIST[@]}" --basetemp "$WORK/sel" "${SELECTION[@]}"
    SEL=$?
    case $SEL in
        0) say "selection: all passed" ;;
        124|137) say "selection: out of time"; RC=4 ;;
        *) say "selection: FAILED (rc=$SEL)"; RC=1 ;;
    esac
    T=$(( $(left) - 70 ))
    if (( T < 30 )); then
        say "fence control skipped: only ${T}s left"
    else
        say "fence negative control: SGLANG_L3_TEST_FAULT=skip-load-fence on ${FENCE[*]} (limit ${T}s)"
        SGLANG_L3_TEST_FAULT=skip-load-fence timeout --kill-after=15 "$T" "${PYTEST[@]}" "${XDIST[@]}" \
            --basetemp "$WORK/fence" "${FENCE[@]}" > "$WORK/fence.log" 2>&1
        FC=$?
        tail -n 3 "$WORK/fence.log"
        case $FC in
            0) say "fence control: every test passed without the fence: no copy overtook the busy forward stream here" ;;
            1) say "fence control: the race test FAILED without the fence, as it must (the fence is what orders it)" ;;
            124|137) say "fence control: out of time" ;;
            *) say "fence control: pytest rc=$FC (see above)" ;;
        esac
    fi
else
    # one collection (one process importing the stack): a node id that is not there fails it
    say "dry run: collecting the selection and the fence control (CACHE_DRY_RUN_TESTS=1 runs them)"
    SGLANG_L3_TEST_FAULT=skip-load-fence "${PYTEST[@]}" --collect-only "${SELECTION[@]}" "${FENCE[@]}" \
        > "$WORK/collect.log" 2>&1
    COL=$?
    tail -n 1 "$WORK/collect.log"
    (( COL == 0 )) || { tail -n 20 "$WORK/collect.log"; say "selection and fence control: collection FAILED"; RC=1; }
    grep -q "^${FENCE[0]}" "$WORK/collect.log" && say "fence control collected: ${FENCE[0]}" \
        || { say "fence control: ${FENCE[0]} not collected"; RC=1; }
fi

# 5. restore_bench on the device (it leaves CACHE_SWITCH_RESERVE_S to step 6 where
#    both fit; what it does not use goes to step 6 too)
T=$(( $(left) - 5 ))
R=${CACHE_SWITCH_RESERVE_S:-90}
(( T - R >= 40 )) || R=0
T=$(( T - R ))
if (( T < 40 )); then say "restore_bench skipped: only ${T}s left"; exit $(( RC ? RC : 4 )); fi
if (( DRY )); then
    RB=(benchmark/restore_bench.py --device cpu --contexts 8192 --models Qwen3.5-27B --buffers 1/16 --repeat 1 --no-upstream)
else
    RB=(benchmark/restore_bench.py --device cuda --contexts "${CACHE_BENCH_CONTEXTS:-32768,131072}" --models Qwen3.5-27B
        --repeat 1 --no-upstream)
fi
say "${RB[*]} (limit ${T}s)"
timeout --kill-after=10 "$T" "$PY" "${RB[@]}" --dir "$WORK/restore-bench"
RBC=$?
case $RBC in
    0) say "restore_bench: done" ;;
    124|137) say "restore_bench: out of time"; (( RC )) || RC=4 ;;
    *) say "restore_bench: a row failed, was skipped or not exact (rc=$RBC)"; (( RC )) || RC=1 ;;
esac
rm -rf "$WORK/restore-bench"

# 6. agent_switch on the device (issue 50): two agents' contexts, one device pool, the
#    arriving one streamed back while the resident's newest turn is written
T=$(( $(left) - 5 ))
if (( T < ${CACHE_SWITCH_MIN_S:-45} )); then
    say "agent_switch skipped: only ${T}s left"
    say "done, rc=$RC"
    exit "$RC"
fi
if (( DRY )); then
    AS=(benchmark/agent_switch.py --device cpu --context 1024 --turn 256 --switches 2 --buffer 0.5)
else
    AS=(benchmark/agent_switch.py --device cuda --context "${CACHE_SWITCH_CONTEXT:-131072}" --switches 4)
fi
say "${AS[*]} (limit ${T}s)"
timeout --kill-after=10 "$T" "$PY" "${AS[@]}" --dir "$WORK/agent-switch" > "$WORK/agent_switch.out" 2>&1
ASC=$?
grep -v "^\[" "$WORK/agent_switch.out"
LAST=$(tail -n 1 "$WORK/agent_switch.out")
case $ASC in
    0) if [[ $LAST == switch_vs_store=*" a_pages_in_l3=yes exact=yes "* ]]; then say "agent_switch: done"
       else say "agent_switch: a switch was not exact or a turn is missing from L3"; (( RC )) || RC=1; fi ;;
    124|137) say "agent_switch: out of time"; (( RC )) || RC=4 ;;
    *) tail -n 5 "$WORK/agent_switch.out"; say "agent_switch: FAILED (rc=$ASC)"; (( RC )) || RC=1 ;;
esac
rm -rf "$WORK/agent-switch"
say "done, rc=$RC"
exit "$RC"
