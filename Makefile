# Crucible developer commands. `make demo` sets up a fresh machine and runs the main job;
# `make test` runs lint and the test suite (what CI runs).
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PACKAGES := shared/pyproject.toml models/pyproject.toml cli/pyproject.toml services/*/pyproject.toml

.PHONY: setup dev toolchains demo sandbox-demo test test-all lint format bench clean compose-test base-images

# The runtime: every service, the CLI, and the CPU build of torch (a laptop never pulls CUDA wheels).
setup: $(STAMP)

# Our packages are built with the venv's own setuptools (--no-build-isolation: no throwaway build
# environment per package, a minute less on a 2-core machine; every other requirement is a wheel),
# and without setuptools' "Editable installation" notice, printed once per package otherwise.
PIP := $(BIN)/python -m pip
$(STAMP) $(DEV_STAMP): export PYTHONWARNINGS = ignore:Editable installation

$(STAMP): requirements.txt requirements-nodeps.txt $(PACKAGES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=68"
	$(PIP) install -q --no-deps -r requirements-nodeps.txt
	$(PIP) install -q --no-build-isolation -r requirements.txt
	touch $(STAMP)

# Plus the test, lint and deployment-check tools.
dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP) requirements-dev.txt
	$(PIP) install -q -r requirements-dev.txt
	touch $(DEV_STAMP)

# The sandbox's languages beside Python (C++, Java, JavaScript, Go, Rust, Bash) from Debian packages:
# installs what is missing when run as root, a no-op when all are present (deploy/toolchains.sh).
toolchains:
	sh deploy/toolchains.sh

demo: setup
	$(BIN)/crucible demo

sandbox-demo: setup
	$(BIN)/python -m crucible_sandbox.demo

# Two pytest-xdist workers, each taking a whole test file at a time (a module's services start
# once): much of the suite waits on spawned services and subprocesses. Each worker has its own
# Redis, sandbox uids and temporary directories (tests/integration/conftest.py, stack_fixtures.py).
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2

test: dev lint toolchains
	$(BIN)/python -m pytest -m "not gpu" -q -n $(TEST_WORKERS) --dist loadfile

test-all: dev
	$(BIN)/python -m pytest -q

lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy shared/crucible_shared services/gateway/crucible_gateway services/sandbox/crucible_sandbox

format: dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup toolchains
	$(BIN)/python bench/sandbox.py throughput
	$(BIN)/python bench/sandbox.py languages
	$(BIN)/python bench/generator.py overhead
	$(BIN)/python bench/gateway.py streams

# The compose stack for real (docs/deploy.md, "Testing the deployment"): builds the images, runs the
# demo job through the gateway, restarts and kills services. Needs Docker; not part of `make test`.
# COMPOSE_TEST_ARGS: e.g. --local-base (base images from Debian packages), --gpu-images, --keep.
compose-test: setup
	$(BIN)/python deploy/compose_test.py $(COMPOSE_TEST_ARGS)

# Base images from Debian packages, for hosts without a registry (deploy/base-images.sh).
base-images:
	bash deploy/base-images.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
