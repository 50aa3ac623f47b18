"""``Omni(model=dir).generate`` on neuron equals diffusers' Wan pipeline on the CPU."""
import numpy as np
import pytest
from omni_tiny_wan import FLOW_SHIFT, PROMPT, REQUEST

# vLLM-Omni runs Wan through its own transformer (its own rotary embedding, norms and
# attention layout), not diffusers' module, so float32 rounding differs by op order: 2e-4
# in [0, 1] pixels measured; a wrong seed, solver or device result is off by > 1e-2.
ATOL = 1e-3


@pytest.fixture(scope="module")
def omni(wan_dir):
    from vllm_omni import Omni
    engine = Omni(model=str(wan_dir), dtype="float32")
    yield engine
    engine.close()


def _generate(omni, seed):
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    params = OmniDiffusionSamplingParams(seed=seed, extra_args={"flow_shift": FLOW_SHIFT},
                                         **REQUEST)
    out = omni.generate([PROMPT], params)
    assert len(out) == 1 and out[0].error is None, out
    return np.asarray(out[0].images[0])[0]


def test_platform_is_neuron(omni):
    from vllm_omni.platforms import current_omni_platform
    assert type(current_omni_platform).__name__ == "NeuronOmniPlatform"
    assert str(current_omni_platform.get_torch_device(0)) == "neuron:0"


@pytest.mark.parametrize("seed", [0, 7])
def test_video_equals_diffusers_on_cpu(omni, cpu_video, seed):
    video = _generate(omni, seed)
    ref = cpu_video(seed)
    assert video.shape == ref.shape == (5, 32, 32, 3)
    np.testing.assert_allclose(video, ref, rtol=0, atol=ATOL)
    # The tolerance separates seeds: another seed's video is far outside it.
    assert np.abs(video - cpu_video(seed + 1)).max() > 10 * ATOL
