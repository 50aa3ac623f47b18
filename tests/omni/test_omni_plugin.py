"""The ``vllm_omni.platform_plugins`` entry point and what the platform answers."""
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest


def _register_in_subprocess(env_extra):
    env = dict(os.environ, **env_extra)
    code = ("from torch_neuronx.vllm.omni_platform import register; print(register())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm_omni.platform_plugins")}
    assert eps.get("neuron") == "torch_neuronx.vllm.omni_platform:register"


def test_register_returns_platform_with_device():
    assert _register_in_subprocess({}) == "torch_neuronx.vllm.omni_platform.NeuronOmniPlatform"


def test_register_stands_aside_when_device_disabled():
    assert _register_in_subprocess({"NEURON_RT_NUM_CORES": "0"}) == "None"


def test_platform_is_both_platforms():
    from vllm_omni.platforms.interface import OmniPlatform

    from torch_neuronx.vllm.omni_platform import NeuronOmniPlatform
    from torch_neuronx.vllm.platform import NeuronPlatform
    assert issubclass(NeuronOmniPlatform, NeuronPlatform)
    assert issubclass(NeuronOmniPlatform, OmniPlatform)
    assert NeuronOmniPlatform().is_out_of_tree()


def test_attention_backend():
    from torch_neuronx.vllm.omni_platform import NeuronOmniPlatform
    path = NeuronOmniPlatform.get_diffusion_attn_backend_cls(None, 64)
    assert path == NeuronOmniPlatform.get_diffusion_attn_backend_cls("torch_sdpa", 64)
    with pytest.raises(ValueError, match="FLASH_ATTN.*neuron"):
        NeuronOmniPlatform.get_diffusion_attn_backend_cls("FLASH_ATTN", 64)


def test_neuron_sdpa_equals_cpu():
    import torch

    from torch_neuronx.vllm.omni_attention import NeuronSDPABackend
    impl = NeuronSDPABackend.get_impl_cls()(num_heads=2, head_size=16, softmax_scale=0.25,
                                            causal=False, num_kv_heads=2)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.25).transpose(1, 2)
    out = impl.forward(q.to("neuron"), k.to("neuron"), v.to("neuron")).cpu()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_diffusion_worker_is_omnis_own_with_modelled_time():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

    from torch_neuronx.vllm.omni_platform import NeuronOmniPlatform
    cls = resolve_obj_by_qualname(NeuronOmniPlatform.get_diffusion_worker_cls())
    assert issubclass(cls, DiffusionWorker)
    assert callable(cls.modelled_summary) and callable(cls.reset_modelled_summary)
