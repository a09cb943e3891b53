# sparsetier: `make test` runs every check, `make demo` the main job.
# The venv lives outside the checkout; set SPARSETIER_VENV to put it elsewhere.

SPARSETIER_VENV ?= $(HOME)/.cache/sparsetier/venv
VENV := $(SPARSETIER_VENV)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sparsetier-deps-$(shell cat requirements-dev.txt requirements-vllm.txt Makefile | sha1sum | cut -c1-12)
# vLLM's own KV-offload tests, from its sdist (its wheel has none): the spec of sparsetier.vllm.
VLLM_VERSION := 0.33.0
export SPARSETIER_VLLM_TESTS := $(VENV)/vllm-tests-$(VLLM_VERSION)
# NVRTC of the CUDA 13.0 series (the GPU machine's driver), kept apart from torch's own NVRTC:
# the CI test compiles cuda/*.cu with it for sm_90.
NVRTC_DIR := $(VENV)/nvrtc-13.0
export SPARSETIER_NVRTC_DIR := $(NVRTC_DIR)/nvidia/cu13/lib
export VIRTUAL_ENV := $(VENV)
export PATH := $(VENV)/bin:$(PATH)

.PHONY: test demo venv sysdeps build wheel lint rust-test py-test plan bench clean

test: venv build lint rust-test py-test

$(PY):
	python3 -m venv $(VENV)

$(STAMP): requirements-dev.txt requirements-vllm.txt | $(PY)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-vllm.txt
	$(PY) scripts/fetch_vllm_tests.py $(VLLM_VERSION) $(SPARSETIER_VLLM_TESTS)
	$(PY) -m pip install --quiet --upgrade --target $(NVRTC_DIR) "nvidia-cuda-nvrtc>=13.0,<13.1"
	touch $@

venv: $(STAMP) sysdeps

# The test builds need a C++ compiler (the device resolver's kernel compiled for the CPU).
# Mooncake Store's master needs libibverbs even over TCP: installed as root (CI); elsewhere
# the Mooncake tests skip and say why.
sysdeps:
	@if ! command -v c++ >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && apt-get install -y -qq g++ >/dev/null; \
		else echo "error: the test builds compile cuda/resolve.cu for the CPU: install a C++ compiler" >&2; exit 1; fi; \
	fi
	@if ! (ldconfig -p 2>/dev/null || /sbin/ldconfig -p) | grep -q libibverbs.so.1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null) || \
			echo "warning: could not install libibverbs1: Mooncake tests will skip"; \
		else echo "note: libibverbs1 missing and not root: Mooncake tests will skip"; fi; \
	fi

# A release wheel: the library without the test hooks (the `testing` feature), into dist/.
wheel: venv
	maturin build --release --out dist

build: venv
	maturin develop --release --quiet --features testing,host-kernel

lint: venv
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features host-kernel -- -D warnings
	cargo clippy --features python -- -D warnings
	cargo clippy --features testing -- -D warnings
	cargo clippy --features testing,host-kernel -- -D warnings
	ruff check python tests
	ruff format --check python tests

rust-test: sysdeps
	cargo test --quiet --features host-kernel

py-test: build
	python -m pytest

demo: build
	sparsetier demo

plan: build
	sparsetier plan --layers 61 --kv-heads 8 --head-dim 128 --device-gb 40 --hicache-size 200

# Criterion benches (alloc, directory, prefix, scheduler, offload), then the Python ones; figures:
# benches/RESULTS.md.
bench: build
	cargo bench
	sparsetier bench directory
	sparsetier bench transfer --device cpu
	sparsetier bench prefix --page-size 1
	sparsetier bench prefix --page-size 16
	sparsetier bench decode --mode block
	sparsetier bench decode --mode token --steps 6
	sparsetier bench vllm

clean:
	cargo clean
	rm -f python/sparsetier/_core*.so
