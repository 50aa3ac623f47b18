# Quick start: `make demo` and `make test` on a fresh machine (Python 3.11, PyPI reachable).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.torchneuron-installed
DEPS := torch==2.13.0 numpy ml_dtypes tqdm pytest pytest-xdist pytest-timeout hypothesis expecttest pyarrow pandas==3.1.1 matplotlib==3.11.2 ninja setuptools wheel transformers

.PHONY: setup build demo test test-hta bench architecture clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(DEPS)
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

# Rebuild the C++ glue in place after editing csrc/.
build: setup
	$(PY) setup.py -q build_ext --inplace

demo: setup
	$(VENV)/bin/torchneuron demo

test: setup
	$(PY) -m pytest -q -n 2 --timeout 900 tests

# Holistic Trace Analysis pulls Jupyter, so it gets its own target (and CI step).
test-hta: setup
	$(PY) -m pip install -q HolisticTraceAnalysis==0.5.0
	$(PY) -m pytest -q tests/profiler/hta_check.py

# Redraw docs/architecture.md's dependency diagram from the code.
architecture: setup
	$(PY) tests/house/architecture.py --write

bench: setup
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf build *.egg-info torch_neuronx/*.so
