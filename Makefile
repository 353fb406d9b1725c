# sinkattn: the project's commands. `make run` and `make test` work on a fresh machine (they install first).
PYTHON ?= python3
MAX_JOBS ?= 2
CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda) $(patsubst %/bin/nvcc,%,$(realpath $(shell command -v nvcc 2>/dev/null))))
export CUDA_HOME MAX_JOBS
export CCACHE_DIR ?= $(HOME)/.cache/ccache
TORCH_VERSION ?= 2.14.1

SOURCES := setup.py $(shell find csrc -name '*.h' -o -name '*.cuh' -o -name '*.cu' -o -name '*.cpp' -o -name '*.py' | grep -v instantiations)
STAMP := build/.installed

.PHONY: install deps cutlass run test report bench build-all gpu-check gpu-prebuilt clean

deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==$(TORCH_VERSION)
	@$(PYTHON) -c "import pytest, numpy, matplotlib" 2>/dev/null || $(PYTHON) -m pip install pytest numpy matplotlib
	@$(PYTHON) -c "import transformers" 2>/dev/null || $(PYTHON) -m pip install "transformers==5.24.0"
	@command -v ninja >/dev/null || $(PYTHON) -m pip install ninja

cutlass:
	$(PYTHON) third_party/fetch_cutlass.py

$(STAMP): $(SOURCES)
	$(MAKE) deps cutlass
	$(PYTHON) -m pip install --no-build-isolation --no-deps -e .
	@mkdir -p build && touch $(STAMP)

install: $(STAMP)

run: install
	$(PYTHON) -m sinkattn.report
	$(PYTHON) examples/quickstart.py

test: install
	$(PYTHON) -m pytest -q tests $(PYTEST_ARGS)

report: install
	$(PYTHON) -m sinkattn.report

bench: install
	$(PYTHON) -m bench $(BENCH_ARGS)

# The whole instantiation grid, with ptxas's resource report and the SASS evidence per kernel.
build-all: deps cutlass
	SINKATTN_PTXAS_VERBOSE=1 SINKATTN_CUDA_ARCHS="80;86;90a" SINKATTN_HEADDIMS=64,128,256 SINKATTN_DTYPES=bf16,fp16 \
	  $(PYTHON) -m pip install --no-build-isolation --no-deps -v -e . 2>&1 | tee build/build-all.log | grep -E "ptxas info|spill|error" || true
	$(PYTHON) ../shared/tools/sass_report.py sinkattn/_C*.so || $(PYTHON) tools/sass_report.py sinkattn/_C*.so

gpu-check:
	bash bench/gpu_check.sh

# Kernel objects for a borrowed GPU machine, whose minutes are scarce: the default grid (80;90a) built here,
# copied to .prebuilt/ (git-ignored). There, with carry=[".prebuilt", "third_party/cutlass/include"]:
#   SINKATTN_PREBUILT_KERNELS=$$PWD/.prebuilt SINKATTN_CUDA_ARCHS="80;90a" SINKATTN_EMULATION=0 bash bench/gpu_check.sh
# compiles only api.cpp against that machine's torch (about 50 s on an H200 machine instead of minutes).
gpu-prebuilt: install
	rm -rf .prebuilt && mkdir -p .prebuilt
	cp build/kernels/*.cu.o build/kernels/build_info.cpp.o .prebuilt/
	@echo "gpu-prebuilt: $$(ls .prebuilt | wc -l) kernel objects in .prebuilt/ ($$(du -sh .prebuilt | cut -f1))"

clean:
	rm -rf build csrc/instantiations sinkattn/_C*.so *.egg-info
