"""A graph holding an op in a dtype CPU refuses and CUDA takes (integer ``histc``, as
Transformers' MoE routing calls it) compiles on neuron and equals eager neuron, which
computes CUDA's result; the same op in a CPU dtype keeps the host path."""
import logging

import pytest
import torch

import torch_neuronx  # noqa: F401


@pytest.fixture(autouse=True)
def _no_compile_caches():
    # The log says which path compiled the graph; a cache hit would compile nothing.
    import torch._functorch.config as aot_config
    import torch._inductor.config as inductor_config
    with inductor_config.patch(fx_graph_cache=False), aot_config.patch(enable_autograd_cache=False):
        yield


def _route(x):
    # Mixtral's expert counts: integer histc over the selected expert ids.
    return torch.histc(x, bins=8, min=0, max=7) * 2


def test_integer_histc_compiles_and_equals_eager(caplog):
    torch._dynamo.reset()
    ids = torch.randint(0, 8, (64,), dtype=torch.int32).to("neuron")
    with caplog.at_level(logging.DEBUG, logger="torch_neuronx.compile.host"):
        got = torch.compile(_route, backend="neuron")(ids)
    want = _route(ids)
    assert got.device.type == "neuron" and got.dtype == want.dtype == torch.int32
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0)
    counts = torch.bincount(ids.cpu().long(), minlength=8).to(torch.int32) * 2
    torch.testing.assert_close(got.cpu(), counts, rtol=0, atol=0)
    assert any("CPU has no such kernel" in r.getMessage() for r in caplog.records)


def test_float_histc_keeps_the_host_path(caplog):
    torch._dynamo.reset()
    x = torch.rand(64).to("neuron") * 7
    with caplog.at_level(logging.DEBUG, logger="torch_neuronx.compile.host"):
        got = torch.compile(_route, backend="neuron")(x)
    torch.testing.assert_close(got.cpu(), _route(x.cpu()), rtol=0, atol=0)
    assert not any("CPU has no such kernel" in r.getMessage() for r in caplog.records)
