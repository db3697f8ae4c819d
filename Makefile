# crabd: two commands for a newcomer, both as root.
#   make demo   prepare the host (idempotent) and show crabd's main job
#   make test   prepare the host and run every test (unit + integration)
#   make lint   ruff and mypy at the level pyproject.toml states (no root)
# These hosts have no sudo: when not root, re-run through sudo only if it
# exists, else say to run as root.

SHELL := /bin/bash
PYTEST_ARGS ?=
RUFF ?= .venv/bin/ruff
MYPY ?= .venv/bin/mypy

.PHONY: demo test setup unit lint wheel-check help

help:
	@echo "make demo   - prepare this host and run the crabd demo (root)"
	@echo "make test   - prepare this host and run all tests (root)"
	@echo "make unit   - unit tests only (no root needed, after setup)"
	@echo "make lint   - ruff and mypy (after setup)"
	@echo "make wheel-check - a wheel of this tree installs and runs (after setup)"

# One shell line per target, so that `exec sudo` replaces it and nothing
# after it runs as the unprivileged user.
AS_ROOT = if [ "$$(id -u)" != 0 ]; then \
	    if command -v sudo >/dev/null 2>&1; then exec sudo $(MAKE) $@; fi; \
	    echo "make $@ needs root (it prepares the host, runs runc, mounts file systems, loads BPF)."; \
	    echo "Run it as root; this host has no sudo."; exit 1; \
	fi;

setup:
	@$(AS_ROOT) scripts/setup-host

demo:
	@$(AS_ROOT) scripts/setup-host && .venv/bin/python scripts/demo.py

test:
	@$(AS_ROOT) scripts/setup-host && scripts/run-tests $(PYTEST_ARGS)

unit:
	@.venv/bin/python -m pytest -q tests/unit

lint:
	$(RUFF) check .
	$(MYPY)

wheel-check:
	@scripts/check-wheel
