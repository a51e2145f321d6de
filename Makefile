# Two commands do the whole set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-zoo lint bench survey clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fxprep demo

test: $(STAMP)
	$(BIN)/python -m ruff check src tests benchmarks
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

# Two workers for the zoo, then the models of 100M+ parameters one at a time (two of them at once
# need more than 24 GB). For those, glibc gives every allocation over 64 KB its own mapping, returned
# on free: with its default (a threshold that grows to 32 MB) the weights of one model after another
# stayed in the heap and one process reached 24 GB by the 34th model.
test-zoo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "zoo and not serial"
	OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 $(BIN)/python -m pytest -q -m "zoo and serial"

lint: $(STAMP)
	$(BIN)/python -m ruff check src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/prepare_bench.py

survey: $(STAMP)
	$(BIN)/fxprep survey --zoo torchvision --jobs 1 -o docs/survey-torchvision.md

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
