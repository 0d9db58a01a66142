# The two commands of README.md:   make up   (install + run the stack)   make test
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ragline-installed

.PHONY: install up test lint format clean

# Re-installing regenerates the protobuf/gRPC stubs (setup.py runs grpcio-tools).
install: $(STAMP)
$(STAMP): pyproject.toml setup.py $(wildcard proto/ragline/v1/*.proto)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,export]'
	touch $@

up: install
	$(BIN)/ragline up

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info libs/ragline/v1/*_pb2*.py libs/ragline/v1/*_pb2*.pyi .ragline
