# Crucible developer commands. `make demo` sets up a fresh machine and runs the main job;
# `make test` runs the test suite (what CI runs).
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo sandbox-demo test test-all lint format bench clean compose-test base-images

setup: $(STAMP)

# torch is pinned to the CPU build so a laptop without a GPU never pulls CUDA wheels.
$(STAMP): requirements.txt requirements-nodeps.txt shared/pyproject.toml services/*/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -q -r requirements.txt
	touch $(STAMP)

demo: setup
	$(BIN)/crucible demo

sandbox-demo: setup
	$(BIN)/python -m crucible_sandbox.demo

test: setup
	$(BIN)/python -m pytest -m "not gpu" -q

test-all: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python bench/sandbox_throughput.py
	$(BIN)/python bench/generator.py

# The compose stack for real (docs/deploy.md, "Testing the deployment"): builds the images, runs the
# demo job through the gateway, restarts and kills services. Needs Docker; not part of `make test`.
# COMPOSE_TEST_ARGS: e.g. --local-base (base images from Debian packages), --gpu-images, --keep.
compose-test: setup
	$(BIN)/python deploy/compose_test.py $(COMPOSE_TEST_ARGS)

# Base images from Debian packages, for hosts without a registry (deploy/base-images.sh).
base-images:
	bash deploy/base-images.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
