VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

# torch is pinned and installed first so pip never resolves the multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/quickdraft demo

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check quickdraft tests

clean:
	rm -rf $(VENV) build *.egg-info
