#!/bin/bash
# Builds sinkattn's sm80-family units of this tree (default: the hd128 bf16 forward and backward) with the
# build's own gencode flags for the sm80 family (csrc/generate_kernels.py: compute_80 -> sm_80 and sm_90, plus
# compute_80 PTX) and the build's nvcc flags, plus -Xptxas -v, into $PEER_SASS_DIR/out/sink_<kind>.o.
#
#   bash tools/peer_build_sinkattn.sh [fwd bwd]      # after `make cutlass`; units: csrc/instantiations/<kind>_sm80_hdim128_bf16.cu
#
# SINKATTN_SRC points at another tree (a worktree of an older commit); PEER_HEADDIM picks another head dim.
set -e
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
S=${SINKATTN_SRC:-$PWD}; W=${PEER_SASS_DIR:-$PWD/build/peer_sass}; O=$W/out; mkdir -p "$O"
HD=${PEER_HEADDIM:-128}
PY=${PYTHON:-python3}
# The narrow grid's units (csrc/instantiations/ is git-ignored; the build regenerates it for its own grid).
( cd "$S" && SINKATTN_CUDA_ARCHS="80;90a" SINKATTN_HEADDIMS=$HD SINKATTN_DTYPES=bf16 $PY -c '
import sys; sys.path.insert(0, "csrc"); import generate_kernels as g
g.generate("csrc/instantiations", g.parse_grid())' )
GEN=$(cd "$S" && $PY -c 'import sys; sys.path.insert(0, "csrc"); import generate_kernels as g; print(" ".join(g.gencode_flags("sm80", ["80", "90a"])))')
NVCC=$CUDA_HOME/bin/nvcc
INC="-I$S/csrc -I$S/third_party/cutlass/include -I$CUDA_HOME/include"
[ -d "$CUDA_HOME/include/cccl" ] && INC="$INC -I$CUDA_HOME/include/cccl"
FLAGS="-std=c++20 -O3 -DNDEBUG --expt-relaxed-constexpr --use_fast_math -Xcompiler -fPIC -lineinfo -Xptxas=--warn-on-spills -Xptxas -v"
for k in ${@:-fwd bwd}; do
  src=$S/csrc/instantiations/${k}_sm80_hdim${HD}_bf16.cu
  ( time $NVCC $FLAGS $INC $GEN -DSINKATTN_COMPILED_ARCHS='"sm_80,sm_90,compute_80"' -c "$src" -o "$O/sink_${k}.o" ) > "$O/sink_${k}.ptxas.log" 2>&1
done
echo "sinkattn objects in $O"
