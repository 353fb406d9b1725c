#!/bin/bash
# Line counts of the sm80 forward on one problem, for tools/perf_counts.py (the model's branch weights, no GPU):
# builds tools/perf_counts_harness.cpp with gcov against a tree's host emulation (SINKATTN_SRC: this checkout, or a
# worktree of an older commit) for each head dim, runs it (S keys, full), and writes $OUT/cov_hd<d>.json (gcov's
# JSON). About 25 s of compile and 10-20 s of run per head dim on one core. PERF_COUNTS_SMEM_KB: the shared memory
# per block the tile is chosen for (default 227, an H100 / H200's; 163 an A100's, 99 an sm86's). PERF_COUNTS_BWD=1:
# the backward of the same problem runs too, its lines in the same file (sm80/bwd_kernel.h's body).
# PERF_COUNTS_DECODE=<page size> (0: a contiguous cache): a decode step instead (8 query heads over one KV head, one
# query, PERF_COUNTS_S keys, default 8192), for the decode rows.
#   SINKATTN_SRC=<tree> OUT=build/peer_sass/4d9dcbd/counts bash tools/perf_counts.sh 64 128
set -e
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(dirname "$HERE")
S=${SINKATTN_SRC:-$REPO}; OUT=${OUT:-$REPO/build/perf_counts}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
CUT=${CUTLASS_INC:-$S/third_party/cutlass/include}
[ -d "$CUT" ] || CUT=$REPO/third_party/cutlass/include
INC="-I$S/csrc -I$CUT -I$CUDA_HOME/include"
[ -d "$CUDA_HOME/include/cccl" ] && INC="$INC -I$CUDA_HOME/include/cccl"
# the tiles that ran are those this shared memory per block picks, on this problem: tools/perf_predict.py costs a
# device's kernels only on counts made for its own limit, and each kind of row on its own problem
echo "${PERF_COUNTS_SMEM_KB:-227}" > "$OUT/smem_kb"
if [ -n "$PERF_COUNTS_DECODE" ]; then
  echo "decode ${PERF_COUNTS_DECODE}" > "$OUT/problem"
  RUN="${PERF_COUNTS_S:-8192} c ${PERF_COUNTS_SMEM_KB:-227} decode $PERF_COUNTS_DECODE"
else
  echo "prefill" > "$OUT/problem"
  RUN="${PERF_COUNTS_S:-1024} f ${PERF_COUNTS_SMEM_KB:-227} ${PERF_COUNTS_BWD:+bwd}"
fi
for hd in ${@:-64 128}; do
  W=$OUT/hd$hd; rm -rf "$W"; mkdir -p "$W"
  ( cd "$W" && { g++ -std=c++20 -O1 --coverage -fprofile-update=atomic -fno-strict-aliasing -pthread -DNDEBUG \
      -DHD=$hd -DSINKATTN_COMPILED_ARCHS='"host"' ${PERF_COUNTS_BWD:+-DPERF_COUNTS_BWD} $INC "$HERE/perf_counts_harness.cpp" -o harness > build.log 2>&1 \
      || { cat build.log; exit 1; }; } \
    && ./harness $RUN \
    && gcov --json-format --stdout harness-perf_counts_harness.gcda > "$OUT/cov_hd$hd.json" 2>/dev/null )
  echo "$OUT/cov_hd$hd.json"
done
