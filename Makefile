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
# the injected dp-communication cause was classified as waiting for the late rank). They also
# start busy processes on purpose (the CPU-contention finding), which must not slow the others.
SERIAL := tests/test_profile.py

train: $(STAMP)
	$(BIN)/shardwise train

# Every phase runs whatever an earlier one gave (a lint error or a failed test in the parallel
# phase must not hide the serial phase's results); at the end, the failing phases and every
# failed test of both pytest phases, and a non-zero exit if any phase failed. A pytest phase
# that PYTEST_ARGS leaves without tests (exit 5) passes. `python -u`: the log is teed live.
test: $(STAMP)
	@out=$$(mktemp -d); trap 'rm -rf "$$out"' EXIT; \
	run() { name=$$1; shift; echo "== make test: $$name"; \
		{ "$$@"; echo $$? > "$$out/$$name.rc"; } 2>&1 | tee "$$out/$$name.log"; }; \
	run format $(BIN)/ruff format --check src tests benchmarks; \
	run lint $(BIN)/ruff check src tests benchmarks; \
	run parallel $(BIN)/python -u -m pytest -q --timeout=600 -n 2 --dist loadfile \
		--no-loadscope-reorder $(SERIAL:%=--ignore=%) $(PYTEST_ARGS); \
	run serial $(BIN)/python -u -m pytest -q --timeout=600 $(SERIAL) $(PYTEST_ARGS); \
	failed=""; for name in format lint parallel serial; do rc=$$(cat "$$out/$$name.rc"); \
		case $$name:$$rc in *:0|parallel:5|serial:5) ;; *) failed="$$failed $$name(exit $$rc)";; \
		esac; done; \
	if [ -z "$$failed" ]; then echo "== make test: every phase passed"; exit 0; fi; \
	echo "== make test: failed phase(s):$$failed"; \
	grep -h -E '^(FAILED|ERROR) ' "$$out/parallel.log" "$$out/serial.log"; exit 1

lint: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache

# every benchmark's --smoke run, the nine the test suite leaves out included (tests/test_benchmarks.py)
bench-smoke: $(STAMP)
	cd benchmarks && for f in *.py; do case $$f in common.py|smoke_all.py) ;; \
	*) echo "== $$f"; ../$(BIN)/python $$f --smoke > /dev/null || exit 1;; esac; done
