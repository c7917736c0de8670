# Two commands do all the set-up on a fresh Debian machine with Python 3.11:
#   make demo   - install, start the local broker and Redis, run the 2 regions x 2 learners demo
#   make test   - install, run the test suite (the tests start their own services)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
CONFIG ?= configs/local.yaml

.PHONY: install system-deps demo test up down status clean

install: system-deps $(VENV)/.installed

system-deps:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server; }

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

up: install
	$(BIN)/diloco infra up --config $(CONFIG)

down:
	$(BIN)/diloco infra down

status:
	$(BIN)/diloco infra status --config $(CONFIG)

demo: up
	$(BIN)/diloco train --config $(CONFIG) --summary-json .diloco/demo-summary.json

test: install
	$(BIN)/pytest -q

clean: down
	rm -rf .diloco
