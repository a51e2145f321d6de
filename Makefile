# Two commands do the whole set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs: `make demo` the library and the model
# zoos its demo prepares (the `demo` extra), `make test` everything the suite and the docs need (`dev`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-oldest test-llmcompressor test-zoo lint typecheck docs dist bench survey newcomer cli-startup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# What the demo needs and no more: torch, torchvision and transformers, no toolkit (AIMET, NNCF...),
# no test or docs tools: 65 packages, not 200. pip shows what it downloads; each step says what it is
# doing, since a first install is minutes of downloads. torch is what pip picks by default (on Linux with
# its CUDA libraries, ~5 GB of the ~5.7 GB); DEMO_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# takes torch's CPU build (~1 GB) instead. An environment `make test` set up is used as it is.
DEMO_PIP_ARGS ?=
$(DEMO_STAMP): pyproject.toml
	@echo "make demo [1/3]: a virtual environment in $(VENV)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "make demo [2/3]: installing fxprep and the model zoos the demo prepares (torch, torchvision, transformers);"
	@echo "                 the first time this downloads ~1 GB (torch's CPU build) to ~5 GB (with CUDA): minutes"
	$(BIN)/python -m pip install --progress-bar on $(DEMO_PIP_ARGS) -e ".[demo]"
	touch $(DEMO_STAMP)

DEMO_ENV := $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
demo: $(DEMO_ENV)
	@echo "make demo [3/3]: fxprep demo: five models prepared, verified and reported (about a minute on one core)"
	$(BIN)/fxprep demo

# A test still running after TEST_TIMEOUT seconds fails with every thread's stack (pytest-timeout) and
# the run goes on, so a hang names itself instead of running CI out of its time. The slowest test
# takes ~90 s on 2 cores; the limit is ten times that.
TEST_TIMEOUT ?= 900
# --max-worker-restart=0: a worker that crashes (killed for memory, a segfault) fails the run at once,
# naming its test; with --dist loadfile, pytest-xdist 3.8's replacement worker reruns the crashed
# file from its start and the run hangs until CI's time limit (pytest-xdist issues 784 and 1323).
PYTEST_FLAGS := -q -n 2 --dist loadfile --max-worker-restart=0 --timeout=$(TEST_TIMEOUT) --durations=15

test: $(STAMP)
	$(BIN)/python -m ruff check src tests benchmarks
	$(BIN)/python -m mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(PYTEST_FLAGS) --ignore=tests/llmcompressor

# The smoke subset (tests marked `smoke`) on the oldest supported versions (ci/oldest-requirements.txt),
# in a second environment. uv installs it from its cache (~/.cache/uv) in seconds once the wheels of
# those versions (torch 2.8 with its CUDA libraries: ~3.5 GB) were fetched once.
OLDEST := .venv-oldest
TMPDIR_DIST ?= /tmp
OLDEST_STAMP := $(OLDEST)/.installed
$(OLDEST_STAMP): pyproject.toml ci/oldest-requirements.txt $(STAMP)
	rm -rf $(OLDEST)
	$(BIN)/uv venv -q --python $(BIN)/python $(OLDEST)
	$(BIN)/uv pip install -q --python $(OLDEST)/bin/python -r ci/oldest-requirements.txt -e ".[smoke]"
	touch $(OLDEST_STAMP)

# Only the files holding smoke tests are collected: the others import the toolkits the smoke
# environment does not install.
SMOKE_FILES = $(shell grep -l "mark.smoke" tests/test_*.py)
test-oldest: $(OLDEST_STAMP)
	$(OLDEST)/bin/python -c "import torch, torchvision, transformers, timm; print('oldest:', 'torch', torch.__version__, 'torchvision', torchvision.__version__, 'transformers', transformers.__version__, 'timm', timm.__version__)"
	OMP_NUM_THREADS=1 $(OLDEST)/bin/python -m pytest $(PYTEST_FLAGS) -m "smoke and not zoo" $(SMOKE_FILES)

# llm-compressor's tests (tests/llmcompressor: oneshot(..., pipeline="fxprep"), its data-parallel ranks, the
# hand-off page) in an environment of its own: llmcompressor 0.14 pins torch and transformers below the
# newest (ci/llmcompressor-requirements.txt). pip, not uv: torch's CPU build is in pip's local wheels folder.
LLMC := .venv-llmcompressor
LLMC_STAMP := $(LLMC)/.installed
$(LLMC_STAMP): pyproject.toml ci/llmcompressor-requirements.txt
	rm -rf $(LLMC)
	$(PY) -m venv $(LLMC)
	$(LLMC)/bin/python -m pip install -q --upgrade pip
	$(LLMC)/bin/python -m pip install -q -r ci/llmcompressor-requirements.txt -e ".[llmcompressor]"
	touch $(LLMC_STAMP)

test-llmcompressor: $(LLMC_STAMP)
	$(LLMC)/bin/python -c "import torch, transformers, llmcompressor, compressed_tensors; print('llmcompressor env:', 'torch', torch.__version__, 'transformers', transformers.__version__, 'llmcompressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__)"
	OMP_NUM_THREADS=1 $(LLMC)/bin/python -m pytest $(PYTEST_FLAGS) tests/llmcompressor

# Two workers for the zoo, then the models of 100M+ parameters one at a time (two of them at once
# need more than 24 GB). For those, glibc gives every allocation over 64 KB its own mapping, returned
# on free: with its default (a threshold that grows to 32 MB) the weights of one model after another
# stayed in the heap and one process reached 24 GB by the 34th model.
test-zoo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 -m "zoo and not serial"
	OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 $(BIN)/python -m pytest -q -m "zoo and serial"

lint: $(STAMP)
	$(BIN)/python -m ruff check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/python -m mypy

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# A release as a user gets it: wheel and sdist built and checked, the wheel installed into a clean
# virtual environment (no system packages, nothing from this checkout) running `fxprep demo` from
# another directory. Its dependencies are resolved from the wheel's metadata; torch, torchvision and
# transformers (the demo's models) are held at the oldest tested versions so uv takes them from the
# cache test-oldest filled instead of fetching another 3 GB torch.
dist: $(STAMP)
	rm -rf dist .venv-dist
	$(BIN)/python -m build --outdir dist . > /dev/null
	$(BIN)/python -m twine check --strict dist/*
	$(BIN)/uv venv -q --python $(BIN)/python .venv-dist
	$(BIN)/uv pip install -q --python .venv-dist/bin/python -c ci/oldest-requirements.txt dist/*.whl torchvision transformers
	cd $(TMPDIR_DIST) && $(CURDIR)/.venv-dist/bin/python -c "import fxprep, torch; print('fxprep', fxprep.__version__, 'from', fxprep.__file__, '; torch', torch.__version__)"
	cd $(TMPDIR_DIST) && $(CURDIR)/.venv-dist/bin/fxprep demo

bench: $(STAMP)
	$(BIN)/python benchmarks/prepare_bench.py

# `fxprep --help` and `fxprep --version` (no torch: under a second), timed in fresh processes.
cli-startup: $(DEMO_ENV)
	$(BIN)/python benchmarks/cli_startup.py --fxprep $(BIN)/fxprep

# A newcomer's first hour, scripted: a fresh environment with what `pip install ".[demo]"` installs (not
# this checkout's .venv), then every `fxprep` command of the README, docs/cli.md and docs/checkpoints.md
# run as written, and the mistakes a newcomer makes, each checked for its exit code and its message
# (tests/newcomer.py; tests/test_newcomer.py runs the same commands in the test environment).
NEWCOMER := .venv-newcomer
newcomer:
	rm -rf $(NEWCOMER)
	$(PY) -m venv $(NEWCOMER)
	$(NEWCOMER)/bin/python -m pip install -q --upgrade pip
	$(NEWCOMER)/bin/python -m pip install -q ".[demo]"
	$(NEWCOMER)/bin/python tests/newcomer.py --fxprep $(NEWCOMER)/bin/fxprep

survey: $(STAMP)
	$(BIN)/fxprep survey --zoo torchvision --jobs 1 -o docs/survey-torchvision.md

clean:
	rm -rf $(VENV) $(OLDEST) $(LLMC) $(NEWCOMER) .venv-dist build dist site *.egg-info src/*.egg-info
