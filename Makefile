# Every target sets itself up: a fresh clone needs only `make dev` or `make test`.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The runtime dependencies alone (no mypy, ruff, pytest, ...): enough for `make dev`. A full install counts as one.
RUNTIME_STAMP := $(VENV)/.installed-runtime
PROTOS := $(shell find protos -name '*.proto' | sort)
GENERATED := gpuscaler/generated
# Checked and tested folders that exist in this checkout.
PY_DIRS := $(wildcard gpuscaler tests e2e bench dev image monitoring)
TEST_DIRS := $(wildcard tests e2e)

.PHONY: help venv dev test test-under-load unit e2e e2e-full e2e-keda e2e-node e2e-compose lint typecheck proto proto-check bench chart-test image docs lock clean tools

help: ## List the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --constraint constraints.txt -e '.[dev]'
	touch $@

venv: $(STAMP) ## Create .venv with the pinned dependencies

$(RUNTIME_STAMP): pyproject.toml constraints.txt
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt constraints.txt ]; then \
		echo "$(VENV) already has every dependency"; \
	else \
		test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); \
		echo "installing gpuscaler's runtime dependencies into $(VENV) ('make test' adds the dev tools)"; \
		$(BIN)/pip install --quiet --constraint constraints.txt -e .; \
	fi
	touch $@

# PORT_OFFSET=N moves every port of the stack by N, to run beside another one (a clash says which offset is free).
dev: $(RUNTIME_STAMP) ## Run the dev stack with fake GPUs as local processes (Ctrl-C stops it; PORT_OFFSET=100 moves its ports)
	$(BIN)/python dev/stack.py --port-offset $(or $(PORT_OFFSET),0)

# The tools the tests run, built (or found) before pytest starts, never inside a test's timeout; fixtures only locate
# them. One line per tool: name, version, seconds, built or cached. tests/tools.py lists them; each pin stays by its tool.
tools: $(STAMP) ## Build every pinned tool the tests run (helm, kubeconform, promtool, hadolint, ...) once per machine
	$(BIN)/python -m tests.tools

test: $(STAMP) proto-check lint typecheck tools ## Every check CI runs: generated code, lint, types, tools, unit, e2e, chart
	$(BIN)/pytest $(TEST_DIRS)

test-under-load: $(STAMP) tools ## `make test` with one busy process per core beside it, as on a shared CI runner (tools built first)
	$(BIN)/python -m tests.load -- $(MAKE) test

unit: $(STAMP) tools ## Unit and in-process tests only
	$(BIN)/pytest tests

e2e: $(STAMP) tools ## End-to-end tests against real processes
	$(BIN)/pytest e2e

e2e-full: $(STAMP) tools ## End-to-end tests at full size (10,000 streams, long fuzzing)
	GPUSCALER_E2E_FULL=1 $(BIN)/pytest e2e

e2e-keda: $(STAMP) ## The real KEDA on a loopback control plane (builds etcd, Kubernetes, KEDA once: ~30 min cold)
	$(BIN)/python -m tests.tools keda
	GPUSCALER_E2E_KEDA=1 $(BIN)/pytest e2e/keda -o timeout=600

e2e-node: $(STAMP) ## The chart on a real kubelet, containerd and KEDA (root; builds the image, node tools once)
	$(MAKE) image
	$(BIN)/python -m e2e.node -o timeout=900

# compose.yaml under Docker Compose v5.6.0, the Go CLI (built once from its Go module), on podman's API socket
# (Debian 12's podman, unpacked into the tool cache, never installed), in private namespaces; the machine is checked
# unchanged after.
e2e-compose: $(STAMP) ## compose.yaml under docker compose on podman (root, Debian; builds the image, compose once)
	$(MAKE) image
	$(BIN)/python -m e2e.compose -o timeout=300

lint: $(STAMP) ## ruff check and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP) ## mypy --strict
	$(BIN)/mypy $(PY_DIRS)

PROTOC = PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -I protos
BETTERPROTO2_OUT = --python_betterproto2_opt=client_generation=async,server_generation=async \
	--python_betterproto2_out=$(1)

# The gateway decodes every agent's snapshots with the protobuf runtime's C decoder: hundreds of times faster
# than betterproto2 for a message that arrives thousands of times a second. Only agent.proto needs it.
PB2_PROTOS := protos/gpuscaler/v1/agent.proto
PB2_OUT = --python_out=$(1)/pb2 --pyi_out=$(1)/pb2

proto: $(STAMP) ## Regenerate gpuscaler/generated from protos/
	rm -rf $(GENERATED)
	mkdir -p $(GENERATED)/pb2
	$(PROTOC) $(call BETTERPROTO2_OUT,$(GENERATED)) $(PROTOS)
	$(PROTOC) $(call PB2_OUT,$(GENERATED)) $(PB2_PROTOS)

proto-check: $(STAMP) ## Fail when gpuscaler/generated is not what `make proto` makes (touches nothing)
	@fresh=$$(mktemp -d) && trap 'rm -rf "$$fresh"' EXIT && \
	mkdir -p "$$fresh/pb2" && \
	$(PROTOC) $(call BETTERPROTO2_OUT,$$fresh) $(PROTOS) 2>"$$fresh/.log" >&2 || { cat "$$fresh/.log"; exit 1; }; \
	$(PROTOC) $(call PB2_OUT,$$fresh) $(PB2_PROTOS) 2>>"$$fresh/.log" >&2 || { cat "$$fresh/.log"; exit 1; }; \
	diff -rq -x __pycache__ -x .log "$$fresh" $(GENERATED) || { echo "generated code is stale: run 'make proto'"; exit 1; }

bench: $(STAMP) ## Measurements; writes bench/results/*.json
	$(BIN)/python -m bench

chart-test: $(STAMP) tools ## Helm chart checks with the real helm
	$(BIN)/pytest tests/chart

# The image: podman or docker where one answers and a trial build runs, else buildah (installed with apt-get on first
# use, like mmdebstrap).
# Leaves build/image/gpuscaler-<version>-<arch>.oci.tar and its SBOM (.cdx.json); see image/build.py.
# IMAGE_ARCH=arm64 builds the arm64 image on an amd64 machine with qemu-user-static; PYTHON_IMAGE=python:3.11-slim-bookworm
# builds on an upstream image instead of the Debian base; ENGINE=buildah|podman|docker chooses the engine.
IMAGE_ARCH ?=
IMAGE_FLAGS = $(if $(IMAGE_ARCH),--arch $(IMAGE_ARCH)) $(if $(PYTHON_IMAGE),--python-image $(PYTHON_IMAGE)) \
	$(if $(ENGINE),--engine $(ENGINE))

.PHONY: image-arm64 image-lock

image: ## Build the image into build/image/ and check it (no engine needed: buildah when none answers)
	$(PYTHON) -m image.build image $(IMAGE_FLAGS)

image-arm64: ## The arm64 image (Grace nodes), built here under qemu-user-static
	$(PYTHON) -m image.build image $(IMAGE_FLAGS) --arch arm64

image-lock: ## Re-pin image/debian-packages-<arch>.lock to the Debian archive's versions now
	$(PYTHON) -m image.build lock $(IMAGE_FLAGS)

TOOLS := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/gpuscaler-tools
D2_VERSION := v0.7.2
D2 := $(TOOLS)/d2-$(D2_VERSION)/d2

$(D2):
	GOBIN=$(dir $(D2)) GOFLAGS=-mod=mod go install -trimpath -ldflags='-s -w' oss.terrastruct.com/d2@$(D2_VERSION)

docs: $(STAMP) $(D2) ## Render the docs' diagrams (docs/*.svg from docs/*.d2; builds d2 with Go once)
	$(BIN)/python -m monitoring.dashboard
	$(D2) --layout dagre docs/data-path.d2 docs/data-path.svg
	$(D2) --layout dagre docs/dashboard.d2 docs/dashboard.svg

lock: ## Re-pin constraints.txt from a fresh install of pyproject.toml's dependencies
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install --quiet -e '.[dev]'
	{ sed -n '1,2p' constraints.txt; .lock-venv/bin/pip freeze --exclude-editable | grep -v '^gpuscaler'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .lock-venv

clean: ## Remove the virtual environment and caches
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
