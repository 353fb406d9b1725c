#!/usr/bin/env bash
# make gpu-check: one call on a fresh GPU machine with no network (docs/DESIGN.md section 6).
#
#   1. build only what this GPU needs, with every core (SINKATTN_CUDA_ARCHS from the GPU's compute
#      capability: 90a on cc 9.0, which holds the sm90 kernels and the sm80 kernels as sm_90 SASS;
#      no host-emulated kernels), in place: python setup.py build_ext --inplace
#   1b. with the diagnostic build beside the objects (make gpu-prebuilt packs it into .prebuilt/diagnostic/), on cc
#      9.0: the never-run sm90 kernels' tests on it first (bounded barrier waits: a hang traps in seconds, naming the
#      barrier); a hang there routes the rest of the run to the sm80 kernels (SINKATTN_DISABLE_SM90=1)
#   2. the capability report, then pytest -m gpu (incl. the GPU fuzz mode: tests/test_fuzz.py, SINKATTN_FUZZ_SCALE),
#      then compute-sanitizer's four tools over bench/gpu/sanitize.py's cases (GPU_CHECK_SANITIZE=0 skips; cap
#      GPU_CHECK_SANITIZE_CAP, default 120 s; verdicts PASS / FAIL / NOT RUN in the summary)
#   3. a short benchmark grid (python -m bench --grid check)
#   3b. the SASS time model's prediction beside each measured sinkattn row (bench/gpu/predict_check.py; never fails)
#   and writes everything into one folder: $OUT when set, else bench/results/gpucheck-<timestamp>.
#
# Each step is time-boxed against one deadline (GPU_CHECK_TOTAL, default 450 s: a GPU round is short).
# The folder holds 8 files at most (few, to bring back from the GPU machine): summary.txt, build.log, tests.log,
# bench.log, results.csv, results.md, env.json, plots.png.
#
# A GPU round: on the GPU machine, in the checkout with the CUTLASS headers (third_party/cutlass/include is
# git-ignored: take it along), run `make gpu-check`. To spend the GPU's time on tests rather than compiles, run
# `make gpu-prebuilt` here first, take only .prebuilt.tar.xz along (unpacked there into .prebuilt/; linking prebuilt
# objects needs no CUTLASS header) and run there SINKATTN_PREBUILT_KERNELS=$PWD/.prebuilt SINKATTN_CUDA_ARCHS="80;90a"
# SINKATTN_EMULATION=0 bash bench/gpu/check.sh.
#
# Knobs (environment): SINKATTN_CUDA_ARCHS / SINKATTN_HEADDIMS / SINKATTN_DTYPES / SINKATTN_EMULATION
# (build grid; defaults: by GPU, all head dims, bf16+fp16, no emulation), GPU_CHECK_JOBS (default: nproc;
# the Makefile's MAX_JOBS=2 is for the shared dev box and is ignored here), GPU_CHECK_GRID (check),
# GPU_CHECK_TOTAL, GPU_CHECK_BUILD_CAP (300), GPU_CHECK_DIAGNOSTIC (1; 0 skips step 1b), GPU_CHECK_DIAG_CAP (90: step
# 1b's time box), GPU_CHECK_SM90_CAP (100: the sm90 tests, first), GPU_CHECK_SM90_BWD_CAP
# (120: the sm90 backward's tests, second), GPU_CHECK_TEST_CAP (200),
# GPU_CHECK_BENCH_CAP (150), GPU_CHECK_SANITIZE (1; 0 skips the sanitizers), GPU_CHECK_SANITIZE_CAP (120), GPU_CHECK_TESTS (the test paths of the second test step; default: tests),
# GPU_CHECK_BENCH_ARGS (extra bench arguments; default "--budget-ms 300 --max-reps 100"),
# GPU_CHECK_SKIP_BUILD=1 (use the extension as it is; also how the script is exercised on a CPU),
# PYTHON (python3).
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)  # bench/gpu/ -> the repository
cd "$REPO"
PY=${PYTHON:-python3}
START=$(date +%s)
TOTAL=${GPU_CHECK_TOTAL:-450}
DEADLINE=$((START + TOTAL))
OUT=${OUT:-$REPO/bench/results/gpucheck-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
JOBS=${GPU_CHECK_JOBS:-$(nproc 2>/dev/null || echo 16)}
export MAX_JOBS=$JOBS
GRID=${GPU_CHECK_GRID:-check}
declare -a STEPS=()
FAILED=0

say() { echo "gpu-check: $*" | tee -a "$SUMMARY"; }
now() { date +%s; }
left() { echo $((DEADLINE - $(now))); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

# step NAME LOG TIMEOUT_S CMD...: run a time-boxed step, log its output, record its status.
step() {
  local name=$1 log=$2 limit=$3
  shift 3
  if [ "$limit" -lt 10 ]; then
    say "$name: SKIPPED (only ${limit}s left before the deadline)"
    STEPS+=("$name: skipped (no time left)")
    FAILED=1
    return 1
  fi
  say "$name: start (time box ${limit}s): $*"
  local t0 rc
  t0=$(now)
  timeout -k 15 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local dt=$(($(now) - t0))
  local what="exit $rc"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && what="TIMEOUT after ${limit}s"
  say "$name: $what in ${dt}s (log: $(basename "$log"))"
  STEPS+=("$name: $what, ${dt}s")
  return "$rc"
}

# ---------------------------------------------------------------------------------------------- 0. machine
{
  echo "== date: $(date -u +%FT%TZ)   repo: $REPO   git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)"
  echo "== nproc: $(nproc 2>/dev/null)   jobs: $JOBS   out: $OUT"
  echo "== python: $($PY -c 'import sys; print(sys.version.split()[0])' 2>&1)"
  echo "== torch: $($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1)"
  echo "== nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'not found')"
  echo "== ninja: $(ninja --version 2>/dev/null || echo 'not found')   ccache: $(command -v ccache || echo none)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu,pstate --format=csv 2>&1
  else
    echo "nvidia-smi: not found"
  fi
} >>"$SUMMARY" 2>&1

GPU_CC=""
command -v nvidia-smi >/dev/null && GPU_CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
if [ -z "${SINKATTN_CUDA_ARCHS:-}" ]; then
  case "$GPU_CC" in
    9.0) SINKATTN_CUDA_ARCHS="90a" ;;   # sm90 kernels (sm_90a) + the sm80 kernels compiled to sm_90 SASS
    8.0) SINKATTN_CUDA_ARCHS="80" ;;
    8.6|8.7) SINKATTN_CUDA_ARCHS="86" ;;
    8.9) SINKATTN_CUDA_ARCHS="89" ;;
    *) SINKATTN_CUDA_ARCHS="80;90a" ;;
  esac
fi
export SINKATTN_CUDA_ARCHS
export SINKATTN_EMULATION=${SINKATTN_EMULATION:-0}
export SINKATTN_HEADDIMS=${SINKATTN_HEADDIMS:-64,128,256}
export SINKATTN_DTYPES=${SINKATTN_DTYPES:-bf16,fp16}
say "GPU compute capability '${GPU_CC:-none}': SINKATTN_CUDA_ARCHS=$SINKATTN_CUDA_ARCHS HEADDIMS=$SINKATTN_HEADDIMS DTYPES=$SINKATTN_DTYPES EMULATION=$SINKATTN_EMULATION MAX_JOBS=$MAX_JOBS"

# ---------------------------------------------------------------------------------------------- 1. build
BUILD_CAP=${GPU_CHECK_BUILD_CAP:-300}
TEST_CAP=${GPU_CHECK_TEST_CAP:-200}  # ~300 GPU-marked tests (forward, decode incl. 64 split counts, backward)
BENCH_CAP=${GPU_CHECK_BENCH_CAP:-150}
TEST_MIN=60   # what the later steps keep for themselves when an earlier one runs long
BENCH_MIN=90
SAN_MIN=0     # what the tests leave for the sanitizers (bench/gpu/sanitize.py): 60 s unless GPU_CHECK_SANITIZE=0
[ "${GPU_CHECK_SANITIZE:-1}" = "0" ] || SAN_MIN=60
if [ -n "${SINKATTN_PREBUILT_KERNELS:-}" ] && [ -f .prebuilt.tar.xz ] && [ ! -f "$SINKATTN_PREBUILT_KERNELS/cutlass_version.txt" ]; then
  mkdir -p "$SINKATTN_PREBUILT_KERNELS" && tar -C "$SINKATTN_PREBUILT_KERNELS" -xJf .prebuilt.tar.xz && say "unpacked .prebuilt.tar.xz"
fi
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = "1" ]; then
  say "build: skipped (GPU_CHECK_SKIP_BUILD=1)"
  STEPS+=("build: skipped by request")
else
  if [ -z "${SINKATTN_PREBUILT_KERNELS:-}" ] && [ -z "${SINKATTN_CUTLASS_DIR:-}" ] && [ ! -f third_party/cutlass/include/cute/tensor.hpp ]; then
    say "build: CUTLASS headers missing at third_party/cutlass/include (git-ignored; there is no network here):"
    say "       take third_party/cutlass/include along to this machine, or set SINKATTN_CUTLASS_DIR"
  fi
  # The diagnostic build (make gpu-prebuilt packs it into diagnostic/): linked in a copy of the tree, beside the
  # normal build and at the same time, so the never-run sm90 kernels run on it first (step 1b).
  DIAG_DIR=""
  if [ -n "${SINKATTN_PREBUILT_KERNELS:-}" ] && [ -f "$SINKATTN_PREBUILT_KERNELS/diagnostic/cutlass_version.txt" ] \
      && [ "$GPU_CC" = "9.0" ] && [ "${GPU_CHECK_DIAGNOSTIC:-1}" != "0" ]; then
    DIAG_DIR=$REPO/build/diagnostic-tree
    rm -rf "$DIAG_DIR" && mkdir -p "$DIAG_DIR"
    tar -C "$REPO" --exclude='sinkattn/_C*' --exclude='__pycache__' -cf - setup.py pyproject.toml csrc sinkattn tools tests \
      | tar -C "$DIAG_DIR" -xf -
    say "diagnostic build: linking the diagnostic kernels in $DIAG_DIR (in the background; log: build.log)"
    (cd "$DIAG_DIR" && SINKATTN_PREBUILT_KERNELS="$SINKATTN_PREBUILT_KERNELS/diagnostic" SINKATTN_DIAGNOSTIC=1 \
      timeout -k 15 "$BUILD_CAP" "$PY" setup.py build_ext --inplace >"$OUT/diag-build.tmp" 2>&1; echo $? >"$OUT/diag-build.rc") &
    DIAG_PID=$!
  fi
  step build "$OUT/build.log" "$(min "$BUILD_CAP" $(($(left) - TEST_MIN - BENCH_MIN)))" \
    "$PY" setup.py build_ext --inplace || FAILED=1
  grep -E "error|warning: .*spill|Error" "$OUT/build.log" | head -20 >>"$SUMMARY"
fi

# ---------------------------------------------------------------------------------------------- 1b. diagnostic run
# The never-run sm90 kernels' tests on the diagnostic build first (docs/DESIGN.md section 8): every mbarrier wait
# there is bounded, so a protocol hang traps in seconds and prints block, warp, barrier and phase ("sinkattn
# diagnostic:" lines, copied into the summary). A hang found here sets SINKATTN_DISABLE_SM90=1 and skips the normal
# build's sm90 steps (they would hang until their time boxes end); a failure without a hang is reported and the
# normal steps still run (the diagnostic build serializes wgmma, so its results should be the normal build's).
SKIP_SM90_STEPS=0
if [ -n "${DIAG_DIR:-}" ]; then
  wait "$DIAG_PID"
  { echo "== diagnostic build (exit $(cat "$OUT/diag-build.rc" 2>/dev/null)):"; cat "$OUT/diag-build.tmp"; } >>"$OUT/build.log"
  rm -f "$OUT/diag-build.tmp"
  if [ "$(cat "$OUT/diag-build.rc" 2>/dev/null)" = "0" ]; then
    echo "== diagnostic run" >>"$OUT/tests.log"
    (cd "$DIAG_DIR" && export PYTHONPATH="$DIAG_DIR" && step diagnostic-sm90 "$OUT/tests.log" \
      "$(min "${GPU_CHECK_DIAG_CAP:-90}" $(($(left) - TEST_MIN - SAN_MIN - BENCH_MIN)))" \
      "$PY" -m pytest -m gpu -x -q -rs -p no:cacheprovider tests/test_gpu_sm90.py tests/test_gpu_sm90_serving.py \
        tests/test_gpu_sm90_backward.py)
    rc=$?
    # (step ran in a subshell: record its verdict here)
    STEPS+=("diagnostic-sm90: exit $rc (the never-run sm90 kernels on the diagnostic build)")
    grep -m 20 "sinkattn diagnostic:" "$OUT/tests.log" >>"$SUMMARY"
    if grep -q "sinkattn diagnostic:" "$OUT/tests.log"; then
      FAILED=1
      SKIP_SM90_STEPS=1
      export SINKATTN_DISABLE_SM90=1
      say "diagnostic-sm90: an sm90 kernel HUNG (see the lines above): SINKATTN_DISABLE_SM90=1, the sm90 steps skipped"
    elif [ "$rc" -ne 0 ]; then
      FAILED=1
      say "diagnostic-sm90: failed without a hang (exit $rc; tests.log): the normal build's sm90 steps still run"
    fi
  else
    FAILED=1
    say "diagnostic build: FAILED (exit $(cat "$OUT/diag-build.rc" 2>/dev/null); build.log): the diagnostic run skipped"
    STEPS+=("diagnostic-sm90: not run (its build failed)")
  fi
fi

# ---------------------------------------------------------------------------------------------- 2. report + GPU tests
{
  echo "== extension:"
  "$PY" -c "import sinkattn; from sinkattn import _ext; print('loaded', _ext.loaded(), _ext.IMPORT_ERROR); [print('  ', k) for k in _ext.registry()]" 2>&1
  echo "== capability report:"
  timeout 60 "$PY" -m sinkattn.report 2>&1 | head -80
} >>"$SUMMARY" 2>&1

PYTEST_EXTRA=()
# A hung test fails alone (pytest-timeout, on the GPU image) instead of eating the whole time box.
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_EXTRA+=(--timeout "${GPU_CHECK_TEST_TIMEOUT:-90}")
# The sm90 kernel first, in its own short time box: if it fails or hangs, SINKATTN_DISABLE_SM90=1 routes
# the remaining tests and the bench to the sm80 kernels, so the run still measures something.
HAS_SM90=$("$PY" -c "from sinkattn import _ext; print(int(any(k['family'] == 'sm90' for k in _ext.registry())))" 2>/dev/null)
if [ "$GPU_CC" = "9.0" ] && [ "$HAS_SM90" = "1" ] && [ "$SKIP_SM90_STEPS" = "0" ]; then
  step sm90-tests "$OUT/tests.log" "$(min "${GPU_CHECK_SM90_CAP:-100}" $(($(left) - TEST_MIN - SAN_MIN - BENCH_MIN)))" \
    "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${PYTEST_EXTRA[@]}" tests/test_gpu_sm90.py \
    tests/test_gpu_sm90_serving.py
  rc=$?
  tail -15 "$OUT/tests.log" >>"$SUMMARY"
  if [ "$rc" -ne 0 ]; then
    FAILED=1
    export SINKATTN_DISABLE_SM90=1
    say "sm90-tests failed (exit $rc): SINKATTN_DISABLE_SM90=1 for the rest of the run"
  fi
fi
# The sm90 backward (written and compiled without a GPU; dispatch does not pick it until it passes here),
# in its own time box too; on failure the bench leaves out its sinkattn-sm90 column.
HAS_SM90_BWD=$("$PY" -c "from sinkattn import _ext; print(int(any(k['family'] == 'sm90' and k['op'] == 'bwd' for k in _ext.registry())))" 2>/dev/null)
SM90_BWD_OK=0
if [ "$GPU_CC" = "9.0" ] && [ "$HAS_SM90_BWD" = "1" ] && [ "$SKIP_SM90_STEPS" = "0" ]; then
  step sm90-bwd-tests "$OUT/tests.log" "$(min "${GPU_CHECK_SM90_BWD_CAP:-120}" $(($(left) - TEST_MIN - SAN_MIN - BENCH_MIN)))" \
    "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${PYTEST_EXTRA[@]}" tests/test_gpu_sm90_backward.py
  rc=$?
  tail -15 "$OUT/tests.log" >>"$SUMMARY"
  if [ "$rc" -ne 0 ]; then
    FAILED=1
    say "sm90-bwd-tests failed (exit $rc): the bench leaves out sinkattn-sm90"
  else
    SM90_BWD_OK=1
  fi
fi
# The serving entry (packed queries over paged caches in one launch, FwdParams::packed_tiles: compiled and emulated,
# never run on a GPU before) and the vLLM backend's graph replays of mixed batches, in their own time box first.
step serving-tests "$OUT/tests.log" "$(min "${GPU_CHECK_SERVING_CAP:-90}" $(($(left) - TEST_MIN - SAN_MIN - BENCH_MIN)))" \
  "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${PYTEST_EXTRA[@]}" tests/test_gpu_serving.py \
  tests/test_vllm_graph_gpu.py
rc=$?
tail -15 "$OUT/tests.log" >>"$SUMMARY"
if [ "$rc" -ne 0 ]; then
  FAILED=1
  say "serving-tests failed (exit $rc)"
fi
# The sm80 decode kernels over FP8 caches (csrc/sm80/fp8_kv.h: compiled and emulated, never run on a GPU before),
# in their own time box too; the main step below then leaves them out (-k "not sm80_fp8").
HAS_FP8=$("$PY" -c "from sinkattn import _ext; print(int(any(k['family'] == 'sm80' and k['op'] == 'fwd_fp8' for k in _ext.registry())))" 2>/dev/null)
NOT_FP8=()
if [ "$HAS_FP8" = "1" ]; then
  step fp8-tests "$OUT/tests.log" "$(min "${GPU_CHECK_FP8_CAP:-90}" $(($(left) - TEST_MIN - SAN_MIN - BENCH_MIN)))" \
    "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${PYTEST_EXTRA[@]}" tests/test_gpu_decode.py -k sm80_fp8
  rc=$?
  tail -15 "$OUT/tests.log" >>"$SUMMARY"
  if [ "$rc" -ne 0 ]; then
    FAILED=1
    say "fp8-tests failed (exit $rc)"
  fi
  NOT_FP8=(-k "not sm80_fp8")
fi
step tests "$OUT/tests.log" "$(min "$TEST_CAP" $(($(left) - SAN_MIN - BENCH_MIN)))" \
  "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${PYTEST_EXTRA[@]}" "${NOT_FP8[@]}" --ignore=tests/test_gpu_sm90.py \
  --ignore=tests/test_gpu_sm90_serving.py --ignore=tests/test_gpu_sm90_backward.py --ignore=tests/test_gpu_serving.py \
  --ignore=tests/test_vllm_graph_gpu.py \
  ${GPU_CHECK_TESTS:-tests}
rc=$?
if [ "$rc" -eq 5 ]; then
  say "tests: pytest collected no GPU test (exit 5)"
elif [ "$rc" -ne 0 ]; then
  FAILED=1
fi
tail -15 "$OUT/tests.log" >>"$SUMMARY"

# ---------------------------------------------------------------------------------------------- 2b. sanitizers
# compute-sanitizer (memcheck with padding, racecheck, synccheck, initcheck) over a small case of every kernel
# family (bench/gpu/sanitize.py), time-boxed. Its full output goes into tests.log (the folder is kept to 8 files);
# the verdicts into the summary. A tool that could not run (no sanitizer, runtime refused it, out of time) is
# reported NOT RUN, never as passed.
SANITIZE_NOTE=""
if [ "${GPU_CHECK_SANITIZE:-1}" = "0" ]; then
  say "sanitize: NOT RUN (GPU_CHECK_SANITIZE=0)"
  STEPS+=("sanitize: NOT RUN (disabled by GPU_CHECK_SANITIZE=0)")
  SANITIZE_NOTE="sanitizers NOT RUN"
else
  SAN_LIMIT=$(min "${GPU_CHECK_SANITIZE_CAP:-120}" $(($(left) - BENCH_MIN)))
  if [ "$SAN_LIMIT" -lt 30 ]; then
    say "sanitize: NOT RUN (only ${SAN_LIMIT}s left before the bench's share of the deadline)"
    STEPS+=("sanitize: NOT RUN (no time left)")
    SANITIZE_NOTE="sanitizers NOT RUN"
  else
    say "sanitize: start (time box ${SAN_LIMIT}s): compute-sanitizer over bench/gpu/sanitize.py cases (output in tests.log)"
    echo "== sanitize: bench/gpu/sanitize.py run --budget $SAN_LIMIT" >>"$OUT/tests.log"
    t0=$(now)
    timeout -k 15 $((SAN_LIMIT + 30)) "$PY" bench/gpu/sanitize.py run --budget "$SAN_LIMIT" --log "$OUT/tests.log" \
      2>&1 | tee -a "$SUMMARY"
    rc=${PIPESTATUS[0]}
    case "$rc" in
      0) STEPS+=("sanitize: PASS (every tool ran, 0 errors), $(($(now) - t0))s") ;;
      1) FAILED=1; STEPS+=("sanitize: FAIL (errors found; see summary and tests.log), $(($(now) - t0))s") ;;
      3) SANITIZE_NOTE="some sanitizers NOT RUN"
         STEPS+=("sanitize: NOT RUN for some tools (see the summary for why), $(($(now) - t0))s") ;;
      *) FAILED=1; SANITIZE_NOTE="sanitizer step broke"
         STEPS+=("sanitize: exit $rc (124/137: stopped by its time box), $(($(now) - t0))s") ;;
    esac
  fi
fi

# ---------------------------------------------------------------------------------------------- 3. bench
BENCH_LIMIT=$(min "$BENCH_CAP" "$(left)")
# Without a passing sm90 backward (or on other GPUs, where the column says n/a anyway), no sinkattn-sm90 column.
BENCH_COMPARATORS=""
[ "$SM90_BWD_OK" = "1" ] || BENCH_COMPARATORS="--comparators $("$PY" -c "from bench.harness import comparators as C; print(','.join(n for n in C.COMPARATORS if n != 'sinkattn-sm90'))" 2>/dev/null || echo sinkattn,sinkattn-sm80,sinkattn-sm80-99k,reference,sdpa-flash,flex,vllm-triton)"
# The harness stops starting cases 40 s before its time box ends, so it always writes its results.
step bench "$OUT/bench.log" "$BENCH_LIMIT" \
  "$PY" -m bench --grid "$GRID" --out "$OUT" --no-progress --time-limit $((BENCH_LIMIT > 80 ? BENCH_LIMIT - 40 : BENCH_LIMIT / 2)) \
  ${GPU_CHECK_BENCH_ARGS---budget-ms 300 --max-reps 100} $BENCH_COMPARATORS || FAILED=1

# ---------------------------------------------------------------------------------------------- 3b. prediction vs measurement
# tools/perf_model.py on this build's SASS beside the bench's rows (every round also tests the model).
# Never fails the round (the script exits 0 and says why when it cannot compare); time-boxed, into the summary.
if [ "$(left)" -gt 20 ]; then
  timeout -k 5 "$(min 90 "$(left)")" "$PY" bench/gpu/predict_check.py --out "$OUT" 2>&1 | tee -a "$SUMMARY" || true
  STEPS+=("predict-check: prediction beside measurement in the summary (never fails the round)")
else
  say "predict-check: NOT RUN (no time left)"
fi

# ---------------------------------------------------------------------------------------------- summary
{
  echo "== after: $(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader 2>&1)"
  echo "== files in $OUT:"
  ls -l "$OUT"
} >>"$SUMMARY" 2>&1
echo
echo "---------------------------------------------------------------- bench (last lines)"
tail -40 "$OUT/bench.log" 2>/dev/null
echo "---------------------------------------------------------------- gpu-check summary"
for s in "${STEPS[@]}"; do echo "  $s"; done | tee -a "$SUMMARY"
TOTAL_S=$(($(now) - START))
say "done in ${TOTAL_S}s; results in $OUT; $([ $FAILED -eq 0 ] && echo OK || echo 'SOME STEPS FAILED')${SANITIZE_NOTE:+ ($SANITIZE_NOTE)}"
exit $FAILED
