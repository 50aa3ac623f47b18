"""The platform plugin is found through its entry point, and stands aside without a device."""
import os
import subprocess
import sys
from importlib.metadata import entry_points


def platform_in_fresh_process(**env):
    code = ("from vllm.platforms import current_platform as p; "
            "print(type(p).__name__, p.device_type)")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()[-2:]


def test_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.platform_plugins")}
    assert eps.get("neuron") == "torch_neuronx.vllm:register"


def test_vllm_picks_neuron_by_itself():
    assert platform_in_fresh_process() == ["NeuronPlatform", "neuron"]


def test_not_loaded_when_the_device_is_disabled():
    # No visible NeuronCore: register() answers None and vLLM keeps its CPU platform.
    assert platform_in_fresh_process(NEURON_RT_NUM_CORES="0") == ["CpuPlatform", "cpu"]


def test_importing_torch_neuronx_does_not_import_the_plugin():
    code = "import sys, torch, torch_neuronx; print('torch_neuronx.vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.split()[-1] == "False", out.stderr[-2000:]
