#!/bin/bash
# Builds FlashAttention-2's bf16 sm80 kernels (the peer of tools/peer_sass.py and tools/perf_model.py) with the nvcc
# flags of FA2's own setup.py, for sm_80 and sm_90 SASS (an H200 runs the sm80 family as sm_90 code).
#
#   bash tools/peer_build_fa2.sh [fwd bwd fwd_causal fwd_hd64 fwd_hd256 bwd_hd64 bwd_hd256]   # default: fwd bwd fwd_causal (hd128)
#
# FA2's source is fetched at run time from its source distribution on the Python package index (flash-attn
# 2.8.3.post2; FLASH_ATTENTION_SKIP_CUDA_BUILD keeps pip from building it) and unpacked in the work folder
# $PEER_SASS_DIR (default build/peer_sass, git-ignored); it never enters the repository. Objects and ptxas logs
# land in $PEER_SASS_DIR/out/fa2_<kind>.o / .ptxas.log. 2-5 minutes per unit on 2 cores.
# c++20, not 17: torch 2.14's headers need it. FLASHATTENTION_DISABLE_{DROPOUT,ALIBI,SOFTCAP,UNEVEN_K,LOCAL} only
# turn run-time switches into constants; the dense variant compared is the same template instance.
set -e
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
W=${PEER_SASS_DIR:-$PWD/build/peer_sass}; O=$W/out; mkdir -p "$O"
PY=${PYTHON:-python3}
V=2.8.3.post2
if [ ! -d "$W/flash_attn-$V" ]; then
  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE $PY -m pip download -q --no-deps --no-build-isolation --no-binary :all: \
    flash-attn==$V -d "$W"
  tar xzf "$W/flash_attn-$V.tar.gz" -C "$W"
fi
F=$W/flash_attn-$V/csrc
T=$($PY -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
NVCC=$CUDA_HOME/bin/nvcc
INC="-I$F/flash_attn -I$F/flash_attn/src -I$F/cutlass/include -I$T -I$T/torch/csrc/api/include -I$CUDA_HOME/include"
FLAGS="-O3 -std=c++20 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math -Xcompiler -fPIC -lineinfo -Xptxas -v -Xptxas=--warn-on-spills"
DIS="-DFLASHATTENTION_DISABLE_DROPOUT -DFLASHATTENTION_DISABLE_ALIBI -DFLASHATTENTION_DISABLE_SOFTCAP -DFLASHATTENTION_DISABLE_UNEVEN_K -DFLASHATTENTION_DISABLE_LOCAL"
GEN="-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_80,code=sm_90"
for k in ${@:-fwd bwd fwd_causal}; do
  case $k in
    fwd) src=flash_fwd_hdim128_bf16_sm80.cu;;
    fwd_causal) src=flash_fwd_hdim128_bf16_causal_sm80.cu;;
    bwd) src=flash_bwd_hdim128_bf16_sm80.cu;;
    fwd_hd64) src=flash_fwd_hdim64_bf16_sm80.cu;;
    fwd_hd256) src=flash_fwd_hdim256_bf16_sm80.cu;;
    bwd_hd64) src=flash_bwd_hdim64_bf16_sm80.cu;;
    bwd_hd256) src=flash_bwd_hdim256_bf16_sm80.cu;;
    *) echo "peer_build_fa2.sh: unknown unit $k" >&2; exit 2;;
  esac
  [ -f "$O/fa2_$k.o" ] && [ "$O/fa2_$k.o" -nt "$F/flash_attn/src/$src" ] && continue
  ( time nice -n 19 $NVCC $FLAGS $DIS $INC $GEN -c "$F/flash_attn/src/$src" -o "$O/fa2_$k.o" ) > "$O/fa2_$k.ptxas.log" 2>&1
done
echo "FA2 objects in $O"
