#!/bin/bash
# The measured peer's SASS without compiling: SDPA's flash backend is FlashAttention-2 inside torch's
# libtorch_cuda.so. This extracts the sm_90 cubins that hold its bf16 forward / backward kernels (head dims 64,
# 128, 256) into $OUT (default build/peer_sass/fa2_torch), for tools/perf_model.py --rows. About 40 s per cubin
# (cuobjdump reads the whole 500 MB library each time). Usage: bash tools/perf_fa2_cubins.sh [sm_90|sm_80]
set -e
ARCH=${1:-sm_90}
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/build/peer_sass/fa2_torch}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: the extraction cds there
LIB=$($PY -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so"))')
C=$($PY -c 'import sys; sys.path.insert(0, "tools"); import sass; print(sass.find_tool("cuobjdump"))')
nice -n 19 "$C" -res-usage "$LIB" > "$OUT/res_usage.txt"
IDX=$($PY - "$OUT/res_usage.txt" "$ARCH" <<'PY'
import re, sys
k, arch, hits = 0, None, set()
for ln in open(sys.argv[1]):
    k += ln.startswith("Fatbin elf code")
    m = re.match(r"arch = (\S+)", ln)
    arch = m.group(1) if m else arch
    m = re.match(r"\s*Function (\S+):", ln)
    if m and arch == sys.argv[2] and "pytorch_flash" in m.group(1) and "splitkv" not in m.group(1) \
            and "bfloat16" in m.group(1) and re.search(r"traitsILi(64|128|256)E", m.group(1)):
        hits.add(k)
print(" ".join(map(str, sorted(hits))))
PY
)
cd "$OUT"
for i in $IDX; do nice -n 19 "$C" -xelf "libtorch_cuda.$i.$ARCH.cubin" "$LIB" >/dev/null; done
ls "$OUT"/*.cubin
