#!/usr/bin/env bash
# make gpu-sweep: one round of kernel tuning on a borrowed GPU (issue 17 item 4; DESIGN.md section 8).
#
# Built here first: `make sweep-prebuilt` puts the default kernels and the tuning variants of
# csrc/generate_kernels.py (SWEEP_SM90, SWEEP_SM80; bf16, 80;90a) into .prebuilt/, with the grid it was built for
# (sweep.txt) and the CUTLASS version (cutlass_version.txt). There, in one call:
#   run(command="make gpu-sweep", carry=[".prebuilt"], timeout_s=600)
#   1. links api.cpp against that machine's torch and the carried objects (no kernel compiles; ~1 min);
#   2. python -m bench.sweep: every variant and default kernel checked against the float64 oracle on small
#      cases (a FAIL is not timed), then every passing one timed on the target shapes, ranked tables printed last;
# writing everything into $OUT (else bench/results/sweep-<timestamp>): run.txt, build.log, sweep.log and
# what bench/sweep.py writes (results.csv, results.md, its summary), 8 files at most.
#
# Knobs: GPU_SWEEP_TOTAL (default 570 s: the deadline of the whole call), GPU_SWEEP_ARGS (extra bench.sweep
# arguments, e.g. "--filter hdim128"), GPU_SWEEP_JOBS (compile jobs when there are no prebuilt objects: nproc).
# Without .prebuilt/ it compiles the grid itself (SINKATTN_SWEEP, default 1) with every core: minutes of the lease.
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE=$((START + ${GPU_SWEEP_TOTAL:-570}))
OUT=${OUT:-$REPO/bench/results/sweep-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
SUMMARY=$OUT/run.txt
: >"$SUMMARY"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
say() { echo "gpu-sweep: $*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE - $(date +%s))); }

{
  echo "== date: $(date -u +%FT%TZ)   git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)   out: $OUT"
  echo "== torch: $($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv 2>&1
} >>"$SUMMARY" 2>&1

# ---------------------------------------------------------------------------------------------- 1. link (or build)
export SINKATTN_DTYPES=bf16 SINKATTN_CUDA_ARCHS="80;90a" SINKATTN_EMULATION=0
if [ -f .prebuilt/sweep.txt ]; then
  export SINKATTN_PREBUILT_KERNELS=$REPO/.prebuilt
  export SINKATTN_SWEEP=$(cat .prebuilt/sweep.txt)
  say "linking the prebuilt objects in .prebuilt/ (SINKATTN_SWEEP=$SINKATTN_SWEEP, $(ls .prebuilt | wc -l) files)"
else
  export SINKATTN_SWEEP=${SINKATTN_SWEEP:-1}
  export MAX_JOBS=${GPU_SWEEP_JOBS:-$(nproc 2>/dev/null || echo 16)}
  say "no .prebuilt/sweep.txt (make sweep-prebuilt, then carry .prebuilt): compiling SINKATTN_SWEEP=$SINKATTN_SWEEP here"
fi
t0=$(date +%s)
timeout -k 15 $(($(left) - 120)) "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1
rc=$?
say "build: exit $rc in $(($(date +%s) - t0))s (log: build.log)"
if [ "$rc" -ne 0 ]; then
  grep -E "error|Error|lacks" "$OUT/build.log" | head -20 | tee -a "$SUMMARY"
  say "the sweep cannot run without the extension"
  exit 1
fi

# ---------------------------------------------------------------------------------------------- 2. the sweep
# bench.sweep keeps its own deadline (it stops starting work in time to write its tables).
SWEEP_LEFT=$(($(left) - 10))
say "sweep: start, deadline ${SWEEP_LEFT}s"
"$PY" -m bench.sweep --out "$OUT" --deadline-s "$SWEEP_LEFT" ${GPU_SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log"
rc=${PIPESTATUS[0]}
say "sweep: exit $rc (0 every variant checked and timed, 1 the harness broke, 2 the deadline cut the run) in $(($(date +%s) - START))s in all; results in $OUT"
exit "$rc"
