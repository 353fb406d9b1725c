#!/bin/bash
# Builds kernel units of a sinkattn tree with that tree's own gencode flags (its csrc/generate_kernels.py) and the
# build's nvcc flags, plus -Xptxas -v, into $PEER_SASS_DIR/out/ (default build/peer_sass/out, git-ignored): the
# objects tools/peer_sass.py and tools/perf_model.py read. No GPU, no install, no link.
#
#   bash tools/peer_build_sinkattn.sh                         # fwd bwd: the hd128 bf16 sm80 units -> sink_fwd.o, sink_bwd.o
#   bash tools/peer_build_sinkattn.sh fwd_sm90_hdim64_bf16 ...  # any unit of the grid -> <unit>.o
#
# SINKATTN_SRC: the tree (default: this one; a worktree of an older commit works the same). PEER_ARCHS: the build's
# arch list (default "80;90a": sm80 units as sm_80 + sm_90 SASS, sm90 units as sm_90a). CUTLASS_INC: the CUTLASS
# headers (default: the tree's third_party/cutlass/include, else this checkout's). Compile niceness and one job at a
# time: each unit takes 1-4 minutes on one core.
set -e
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
S=${SINKATTN_SRC:-$PWD}; W=${PEER_SASS_DIR:-$PWD/build/peer_sass}; O=$W/out; mkdir -p "$O"
PY=${PYTHON:-python3}
ARCHS=${PEER_ARCHS:-80;90a}
CUT=${CUTLASS_INC:-$S/third_party/cutlass/include}
[ -d "$CUT" ] || CUT=$PWD/third_party/cutlass/include
[ -d "$CUT" ] || { echo "peer_build_sinkattn.sh: no CUTLASS headers at $CUT (make cutlass, or CUTLASS_INC=)" >&2; exit 1; }
HDS=64,128,256
# Every unit of a narrow grid (bf16; csrc/instantiations/ is git-ignored, the build regenerates it for its own grid).
( cd "$S" && SINKATTN_CUDA_ARCHS="$ARCHS" SINKATTN_HEADDIMS=$HDS SINKATTN_DTYPES=bf16 SINKATTN_EMULATION=0 $PY -c '
import sys; sys.path.insert(0, "csrc"); import generate_kernels as g
g.generate("csrc/instantiations", g.parse_grid())' )
NVCC=$CUDA_HOME/bin/nvcc
INC="-I$S/csrc -I$CUT -I$CUDA_HOME/include"
[ -d "$CUDA_HOME/include/cccl" ] && INC="$INC -I$CUDA_HOME/include/cccl"
FLAGS="-std=c++20 -O3 -DNDEBUG --expt-relaxed-constexpr --use_fast_math -Xcompiler -fPIC -lineinfo -Xptxas=--warn-on-spills -Xptxas -v"
for k in ${@:-fwd bwd}; do
  case $k in
    fwd|bwd) unit=${k}_sm80_hdim128_bf16; obj=sink_$k;;
    *) unit=$k; obj=$k;;
  esac
  case $unit in *_sm90_*) fam=sm90;; *) fam=sm80;; esac
  read -r GEN LIST < <(cd "$S" && $PY -c 'import sys; sys.path.insert(0, "csrc"); import generate_kernels as g
a = sys.argv[2].split(";"); print(" ".join(g.gencode_flags(sys.argv[1], a)).replace(" ", "@"), g.arch_list_string(sys.argv[1], a))' "$fam" "$ARCHS")
  src=$S/csrc/instantiations/$unit.cu
  [ -f "$src" ] || { echo "peer_build_sinkattn.sh: no unit $unit in $S's grid" >&2; exit 1; }
  [ -f "$O/$obj.o" ] && [ "$O/$obj.o" -nt "$src" ] && continue
  ( time nice -n 19 $NVCC $FLAGS $INC ${GEN//@/ } -DSINKATTN_COMPILED_ARCHS="\"$LIST\"" -c "$src" -o "$O/$obj.o" ) > "$O/$obj.ptxas.log" 2>&1
  echo "$obj.o"
done
echo "sinkattn objects in $O"
