"""Each model family of examples/models trains and infers on neuron exactly as on the CPU.

fp32 and bf16-autocast eager runs equal the CPU bit for bit (the device runs CPU kernels, and
Adaptive Eager's fused kernels are bit-identical to eager), with Adaptive Eager on and off.
One compiled family is checked here against Inductor on the CPU; bench/bench_models.py
compiles them all.
"""
from __future__ import annotations

import importlib
import pathlib
import sys
import warnings

import pytest
import torch

import torch_neuronx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "models"))
_harness = importlib.import_module("_harness")

FAMILIES = {
    "text_llama": "FAMILY", "vlm_llava": "FAMILY", "image_dit": "FAMILY", "video_wan": "FAMILY",
    "ssm_mamba": "FAMILY", "world_rssm": "FAMILY", "moe_mixtral": "FAMILY",
    "moe_grouped": ("moe_mixtral", "GROUPED"),
}


# Device gaps these families found, fixed in the device (issue 21), not in the examples.
_WAITING = {
}


def _cases():
    for name in FAMILIES:
        for dtype, tag in ((None, "fp32"), (torch.bfloat16, "bf16")):
            reason = _WAITING.get((name, tag))
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            yield pytest.param(name, dtype, marks=marks, id=f"{name}-{tag}")


def family(name):
    spec = FAMILIES[name]
    module, attr = (name, spec) if isinstance(spec, str) else spec
    return getattr(importlib.import_module(module), attr)


def _assert_same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max diff {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _assert_close_tree(a, b):
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b, strict=True):
            _assert_close_tree(x, y)
    else:
        _assert_same(a, b, "inference output")


@pytest.fixture
def adaptive_eager(request):
    before = torch_neuronx.is_adaptive_eager_enabled()
    torch_neuronx.set_adaptive_eager(request.param)
    yield request.param
    torch_neuronx.set_adaptive_eager(before)


@pytest.mark.parametrize("adaptive_eager", [True, False], indirect=True, ids=["ae_on", "ae_off"])
@pytest.mark.parametrize("name,dtype", list(_cases()))
def test_eager_equals_cpu(name, dtype, adaptive_eager):
    fam = family(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # no spurious device warnings
        warnings.filterwarnings("ignore", message=".*(deprecated|falling back to its reference).*")
        dev = _harness.run(fam, "neuron", steps=3, dtype=dtype)
    ref = _harness.run(fam, "cpu", steps=3, dtype=dtype)
    if dtype is None:
        assert dev.losses == ref.losses, (dev.losses, ref.losses)
        _assert_same(dev.output, ref.output, "inference output")
    else:
        # neuron's autocast follows CUDA's op lists, the CPU's its own: the two round different
        # ops to bf16, so they agree to bf16's precision, not bit for bit.
        torch.testing.assert_close(torch.tensor(dev.losses), torch.tensor(ref.losses), rtol=2e-2, atol=0)
        _assert_close_tree(dev.output, ref.output)
    assert dev.modelled_ms.get("trn2", 0) > 0


def test_compiled_equals_inductor():
    """A diffusion transformer with the forward compiled: neuron vs Inductor on the CPU."""
    import torch._inductor.config as inductor_config
    fam = family("image_dit")
    with inductor_config.patch(fallback_random=True):
        dev = _harness.run(fam, "neuron", steps=2, compile_backend="neuron")
        ref = _harness.run(fam, "cpu", steps=2, compile_backend="inductor")
    torch.testing.assert_close(torch.tensor(dev.losses), torch.tensor(ref.losses), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dev.output, ref.output, rtol=1e-3, atol=1e-4)
