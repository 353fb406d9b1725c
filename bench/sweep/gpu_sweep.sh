#!/usr/bin/env bash
# make gpu-sweep: one round of kernel tuning on a borrowed GPU (docs/DESIGN.md section 8).
#
# Built here first: `make sweep-prebuilt` puts the default kernels and the tuning variants of csrc/sweep_grid.py
# (SWEEP_SM90, SWEEP_SM80; bf16, 80;90a; the generator compiles them) into .prebuilt/, with the grid it was built for
# (sweep.txt) and the CUTLASS version (cutlass_version.txt), packed into .prebuilt.tar.xz. Take that file to the GPU
# machine with the checkout and run `make gpu-sweep` there (one command, about ten minutes), which
#   1. unpacks .prebuilt.tar.xz into .prebuilt/ and links api.cpp against that machine's torch and the carried
#      objects (no kernel compiles; ~1 min);
#   2. python -m bench.sweep: every variant and default kernel checked against the float64 oracle on small
#      cases (a FAIL is not timed), then every passing one timed on the target shapes, ranked tables printed last;
#      relaunched over the same $OUT when a run dies (a hung kernel ended by the sweep's watchdog, a segfault) or
#      exits 3 (a kernel fault lost the CUDA context): each run resumes from journal.jsonl after the unit that
#      killed the last one, which is FAIL / NOT RUN "hung or crashed the process";
# writing everything into $OUT (else bench/results/sweep-<timestamp>): run.txt, build.log, sweep.log (every run's
# output) and what runner.py writes (results.csv, results.md, summary.txt, journal.jsonl), 7 files, 8 at most.
#
# Knobs: GPU_SWEEP_TOTAL (default 570 s: the deadline of the whole call), GPU_SWEEP_ARGS (extra bench.sweep
# arguments, e.g. "--filter hdim128"), GPU_SWEEP_JOBS (compile jobs when there are no prebuilt objects: nproc),
# GPU_SWEEP_RELAUNCHES (default 8), GPU_SWEEP_SKIP_BUILD=1 (the extension is already built in place: no step 1;
# tests/test_sweep.py runs this script on the CPU that way).
# Without .prebuilt/ it compiles the grid itself (SINKATTN_SWEEP, default 1) with every core: minutes of GPU time.
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)  # bench/sweep/ -> the repository
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
if [ "${GPU_SWEEP_SKIP_BUILD:-0}" = 1 ]; then
  say "build: skipped (GPU_SWEEP_SKIP_BUILD=1: the extension in place is used as it is)"
else
  export SINKATTN_DTYPES=bf16 SINKATTN_CUDA_ARCHS="80;90a" SINKATTN_EMULATION=0
  if [ -f .prebuilt.tar.xz ] && [ ! -f .prebuilt/sweep.txt ]; then
    mkdir -p .prebuilt && tar -C .prebuilt -xJf .prebuilt.tar.xz && say "unpacked .prebuilt.tar.xz"
  fi
  if [ -f .prebuilt/sweep.txt ]; then
    export SINKATTN_PREBUILT_KERNELS=$REPO/.prebuilt
    export SINKATTN_SWEEP=$(cat .prebuilt/sweep.txt)
    say "linking the prebuilt objects in .prebuilt/ (SINKATTN_SWEEP=$SINKATTN_SWEEP, $(ls .prebuilt | wc -l) files)"
  else
    export SINKATTN_SWEEP=${SINKATTN_SWEEP:-1}
    export MAX_JOBS=${GPU_SWEEP_JOBS:-$(nproc 2>/dev/null || echo 16)}
    say "no .prebuilt/sweep.txt (make sweep-prebuilt here, then carry .prebuilt.tar.xz): compiling SINKATTN_SWEEP=$SINKATTN_SWEEP here"
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
fi

# ---------------------------------------------------------------------------------------------- 2. the sweep
# bench.sweep keeps its own deadline (it stops starting work in time to write its tables) and cuts its watchdog
# to it (+3 s), so a run that dies near its deadline leaves MARGIN s for one more to write the files from the
# journal (~5 s: torch, the CUDA context, discovery). Each run also has an outer timeout just short of ours.
MARGIN=12
MIN_RELAUNCH=10
JOURNAL=$OUT/journal.jsonl
# The journal's units (start and result lines; not the "run"/"end" line each process writes): a run that added
# none made no progress, and another would die the same way.
units() { if [ -f "$JOURNAL" ]; then grep -c -v -e '"event": "run"' -e '"event": "end"' "$JOURNAL"; else echo 0; fi; }
# Why run $1's exit calls for another run (prints it), or nothing (status 1) when it ended as the sweep ends.
why_relaunch() {
  case "$1" in
    0 | 2) return 1 ;;
    1) # the harness broke, or faulthandler's watchdog (_exit(1)): that one leaves a unit's "start" last
      local last
      last=$([ -f "$JOURNAL" ] && tail -n 1 "$JOURNAL")
      case "$last" in
        *'"event": "start"'*) # name the unit: "check <variant>" or "time <shape> / <variant>"
          echo "the watchdog ended it in $(echo "$last" |
            sed -e 's/.*"phase": "\([a-z]*\)", "unit": "\([^"]*\)".*/\1 \2/')" ;;
        *) return 1 ;;
      esac ;;
    3) echo "a kernel fault lost the CUDA context (the faulting unit is FAIL in the journal)" ;;
    124 | 137) echo "the outer timeout ended it (exit $1)" ;;
    *) if [ "$1" -gt 128 ]; then echo "signal $(kill -l $(($1 - 128)) 2>/dev/null || echo $(($1 - 128)))"
       else echo "exit $1"; fi ;;
  esac
}

: >"$OUT/sweep.log"
runs=0 relaunches=0 dl_override=""
while :; do
  runs=$((runs + 1))
  L=$(left)
  SWEEP_LEFT=${dl_override:-$((L - MARGIN > 0 ? L - MARGIN : 0))}
  before=$(units)
  say "sweep: run $runs, deadline ${SWEEP_LEFT}s"
  echo "== gpu-sweep: run $runs, deadline ${SWEEP_LEFT}s, $(date -u +%FT%TZ)" >>"$OUT/sweep.log"
  timeout -k 5 $((L > 3 ? L - 2 : 1)) \
    "$PY" -m bench.sweep --out "$OUT" --deadline-s "$SWEEP_LEFT" ${GPU_SWEEP_ARGS:-} 2>&1 | tee -a "$OUT/sweep.log"
  rc=${PIPESTATUS[0]}
  why=$(why_relaunch "$rc") || break
  say "sweep: run $runs ended abnormally: $why"
  [ -n "$dl_override" ] && break  # that was the last run, which only writes the files
  if [ "$(units)" -le "$before" ]; then
    say "sweep: run $runs added nothing to the journal (it died outside any unit): no relaunch"
    break
  fi
  if [ "$(left)" -lt "$MIN_RELAUNCH" ]; then
    say "sweep: $(left)s left: no relaunch"
    break
  fi
  if [ "$relaunches" -ge "${GPU_SWEEP_RELAUNCHES:-8}" ]; then
    say "sweep: $relaunches relaunches already: one more run with --deadline-s 0 writes the files from the journal"
    dl_override=0
  fi
  relaunches=$((relaunches + 1))
done
say "sweep: exit $rc (0 every variant checked and timed, 1 the harness broke, 2 the deadline cut the run, 3 a fault \
lost the CUDA context) after $runs run(s), $(($(date +%s) - START))s in all; results in $OUT"
exit "$rc"
