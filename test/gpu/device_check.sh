#!/usr/bin/env bash
# GPU variant of the server e2e tests (test/e2e, marker `gpu`; with >= 2 GPUs also
# the TP=2 set, step 6) on a fresh, bare machine with one NVIDIA GPU (sized for one H200, 8 minutes in all) and the
# repository copied to the current directory.
#
#   bash test/gpu/device_check.sh            # from the repository root
#
# Best effort, by necessity:
# - The device machine reaches no package index. What is not on its image has to
#   travel with the repository as wheels in ./.whl (git-ignored; see
#   /work/.library/device/README.md for `pip download --platform ...`), and one
#   call carries at most 64 MiB. sglang==0.5.23 itself is small, but its GPU
#   runtime (sgl-kernel, and torch 2.14.1 which 0.5.23 pins) is hundreds of MiB:
#   when the image's torch/Triton cannot run sglang 0.5.23 the check stops at
#   step 2 with the reason instead of pretending.
# - Nothing here needs the network at run time: the model is the packaged tiny
#   Qwen3-Next with dummy weights, fed with input ids.
# Output: the pytest summary and, on failure, the server log tails; $OUT/ (when
# set) receives the logs.
set -uo pipefail
START=$(date +%s)
BUDGET=${DEVICE_CHECK_BUDGET_S:-470}   # 8 min minus margin
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/sglang-l3-site}
OUT_DIR=${OUT:-/tmp/sglang-l3-device-check}
mkdir -p "$OUT_DIR" "$SITE"
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
say() { echo "[device_check +$(( $(date +%s) - START ))s] $*"; }

# 1. GPU present?
if ! "$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "no CUDA device visible to $PY's torch: nothing to check"; exit 2
fi
"$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'

# 2. packages: carried wheels first (offline), then whatever an index offers
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if compgen -G ".whl/*.whl" >/dev/null; then
    say "installing carried wheels from .whl/ into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || { say "wheel install failed"; exit 3; }
fi
if ! "$PY" -c 'import sglang' 2>/dev/null; then
    say "sglang not importable; trying an index (fails fast offline)"
    timeout 120 "$PY" -m pip install -q --no-deps --target "$SITE" --timeout 10 --retries 0 \
        sglang==0.5.23 || true
fi
if ! "$PY" - <<'EOF'
import sys
try:
    import sglang
    from sglang.srt.layers.attention.linear import gdn_backend  # noqa: F401  (Triton GDN path)
    import sglang.srt.entrypoints.http_server  # noqa: F401
except Exception as e:  # noqa: BLE001
    print(f"sglang cannot run here: {type(e).__name__}: {e}")
    sys.exit(1)
if sglang.__version__ != "0.5.23":
    print(f"sglang {sglang.__version__} found; this repository pins 0.5.23")
    sys.exit(1)
print("sglang", sglang.__version__)
EOF
then
    say "sglang 0.5.23 with its GPU runtime is not available on this machine (carry it in .whl/)"
    exit 3
fi

# 3. this package (editable: registers the sglang.srt.plugins entry point)
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" . \
    || { say "installing sglang-l3 failed"; exit 3; }
"$PY" -c 'import sglang_l3.plugin, pytest' || { say "sglang_l3 or pytest not importable"; exit 3; }

# 4. the C++ page-hash extension HiCache builds on first use (see
#    sglang_l3.testing.server.warm_hicache_hash_extension), built up front
timeout 120 "$PY" -c 'from sglang_l3.testing.server import warm_hicache_hash_extension as w; w()' \
    || say "warning: could not pre-build the hash extension"

# 5. the GPU e2e variants, in what is left of the budget
T=$(left)
if (( T < 120 )); then say "only ${T}s left: not starting servers"; exit 4; fi
say "running test/e2e -m 'e2e and gpu' (limit ${T}s)"
SGLANG_L3_E2E_STARTUP_TIMEOUT=$(( T / 3 )) timeout --kill-after=20 "$T" \
    "$PY" -m pytest -q -p no:cacheprovider -m "e2e and gpu" test/e2e \
    --basetemp "$OUT_DIR/pytest" -rA 2>&1 | tee "$OUT_DIR/pytest.log"
RC=${PIPESTATUS[0]}

# 6. TP=2 variants (test/e2e/test_tp2_l3.py on CUDA: P -> flush -> P vs a no-cache
#    TP=2 server, asymmetric damage to one rank's pages, write failure, abort,
#    restart, verify mode catching an injected rank disagreement). Needs >= 2 GPUs;
#    skipped cleanly (and the step's rc ignored) on one.
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if (( NGPU < 2 )); then
    say "TP=2 variants skipped: ${NGPU} GPU(s) visible, TP=2 needs 2"
else
    T=$(left)
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
for f in "$OUT_DIR"/pytest*/*/*.log; do [[ -f $f ]] && cp "$f" "$OUT_DIR/$(basename "$(dirname "$f")")-$(basename "$f")"; done
say "done, rc=$RC"
exit "$RC"
