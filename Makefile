# The README's two set-up commands. Both create .venv and install with constraints.txt, which
# pins torch==2.13.0 so pip takes the CPU wheel on machines without a GPU.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test lint format bench bench-smoke clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# Run alone after the rest (2 xdist workers): the profile tests measure where a step's time
# goes, and another test file busy on the second worker makes one rank a straggler (seen once:
# the injected dp-communication cause was classified as waiting for the late rank).
SERIAL := tests/test_profile.py

train: $(STAMP)
	$(BIN)/shardwise train

test: $(STAMP)
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q --timeout=600 -n 2 --dist loadfile --no-loadscope-reorder \
		$(SERIAL:%=--ignore=%) $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q --timeout=600 $(SERIAL) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache

# every benchmark's --smoke run, the nine the test suite leaves out included (tests/test_benchmarks.py)
bench-smoke: $(STAMP)
	cd benchmarks && for f in *.py; do case $$f in common.py|smoke_all.py) ;; \
	*) echo "== $$f"; ../$(BIN)/python $$f --smoke > /dev/null || exit 1;; esac; done
