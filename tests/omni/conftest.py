"""vLLM-Omni tests run in the Omni environment (``make omni-setup``, ``make test-omni``); other
environments have no vllm_omni and skip this folder at collection."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm_omni") is None:
    collect_ignore_glob = ["test_*.py"]

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def wan_dir(tmp_path_factory):
    import omni_tiny_wan
    return omni_tiny_wan.build(tmp_path_factory.mktemp("tiny-wan"))


@pytest.fixture(scope="session")
def cpu_video(wan_dir):
    """The same pipeline through diffusers on the CPU: ``seed -> frames`` (N, H, W, 3) in
    [0, 1], float32."""
    from omni_tiny_wan import FLOW_SHIFT, PROMPT, REQUEST, reference
    cache = {}

    def run(seed: int):
        if seed not in cache:
            cache[seed] = reference(wan_dir, PROMPT, seed, FLOW_SHIFT, **REQUEST)
        return cache[seed]
    return run


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory):
    import omni_tiny_flux
    return omni_tiny_flux.build(tmp_path_factory.mktemp("tiny-flux"))


@pytest.fixture(scope="session")
def cpu_image(flux_dir):
    """The Flux pipeline through diffusers on the CPU: ``seed -> image`` (H, W, 3) uint8."""
    from omni_tiny_flux import PROMPT, REQUEST, reference
    cache = {}

    def run(seed: int):
        if seed not in cache:
            cache[seed] = reference(flux_dir, PROMPT, seed, **REQUEST)
        return cache[seed]
    return run

