VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install browser demo test lint bench clean

# torch is pinned and installed first so pip never resolves the multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

# The playground test drives Debian's Chromium: installed here when missing and we are root
# (CI, containers); otherwise one line says how (no sudo prompt).
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "make: chromium/chromium-driver missing: the playground test needs them (as root: apt-get install chromium chromium-driver)"; fi

install: $(STAMP) browser

demo: install
	$(VENV)/bin/quickdraft demo

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check quickdraft tests

clean:
	rm -rf $(VENV) build *.egg-info
