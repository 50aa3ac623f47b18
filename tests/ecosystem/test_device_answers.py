"""torch.neuron answers what the libraries ask, as AWS's TorchNeuron does: each check runs the
library's own detection code (never a copy of it) and compares with what the device reports."""
from __future__ import annotations

import warnings

import pytest
import torch

import torch_neuronx


def test_transformers_detection():
    transformers = pytest.importorskip("transformers")
    from transformers.utils import import_utils

    assert import_utils.is_torch_neuron_available()
    assert import_utils.is_torch_neuron_available(check_device=True)
    assert import_utils.is_torch_bf16_gpu_available()       # asks torch.neuron.is_bf16_supported
    assert not import_utils.is_torch_neuroncore_available()  # the XLA stack: not this backend
    args = transformers.TrainingArguments(output_dir="unused", report_to="none")
    assert args.device == torch.device("neuron", 0)
    from transformers.distributed.utils import get_distributed_backend
    assert get_distributed_backend("neuron") == "neuron"
    assert torch.distributed.Backend.default_device_backend_map["neuron"] == "neuron"


def test_accelerate_detection():
    pytest.importorskip("accelerate")
    from accelerate.test_utils.testing import get_backend
    from accelerate.utils import is_neuron_available, set_seed
    from accelerate.utils.environment import get_current_device_type
    from accelerate.utils.memory import clear_device_cache

    assert is_neuron_available() and is_neuron_available(check_device=True)
    assert get_current_device_type() == ("neuron", "MULTI_NEURON")
    name, count, allocated = get_backend()
    assert (name, count) == ("neuron", torch.neuron.device_count())
    x = torch.ones(1 << 16, device="neuron")
    assert allocated() == torch.neuron.memory_allocated() > 0
    del x
    clear_device_cache()                   # torch.neuron.empty_cache
    assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated()
    set_seed(5)                            # reaches torch.neuron.manual_seed_all
    a = torch.rand(4, device="neuron")
    torch.manual_seed(5)
    assert torch.equal(a.cpu(), torch.rand(4))


def test_autocast_accepts_float32_as_on_cuda():
    # TorchTitan (and CUDA code) enter autocast with dtype=float32 when mixed precision is off;
    # torch would disable autocast with a warning if the device did not list float32.
    assert torch.float32 in torch.neuron.get_amp_supported_dtype()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("neuron", dtype=torch.float32):
            assert torch.is_autocast_enabled("neuron")
            y = torch.ones(2, 2, device="neuron") @ torch.ones(2, 2, device="neuron")
    assert y.dtype == torch.float32


def test_device_name_and_properties_as_aws():
    # AWS's names: libraries match "neuron" in get_device_name() and read the platform type
    # from get_device_properties().name (TorchTitan's MFU table); "virtual" is a property.
    assert torch.neuron.get_device_name() == "neuron"
    props = torch.neuron.get_device_properties()
    assert props.name == "trn2" and props.is_virtual
    assert props.peak_tflops["bfloat16"] == pytest.approx(158.0)   # 79 per core x LNC=2
    with pytest.raises(RuntimeError, match="neuron:99"):
        torch.neuron.get_device_name(99)


def test_memory_names_on_torch_neuronx_module():
    # AWS's memory-profiling guide calls these on torch_neuronx itself
    torch.neuron.synchronize()
    torch_neuronx.reset_peak_memory_stats()
    base = torch_neuronx.memory_allocated()
    x = torch.empty(1 << 20, device="neuron")
    assert torch_neuronx.memory_allocated() == base + x.nbytes
    assert torch_neuronx.max_memory_allocated() >= base + x.nbytes
    assert torch_neuronx.memory_reserved() >= torch_neuronx.memory_allocated()
    assert torch_neuronx.max_memory_reserved() >= torch_neuronx.memory_reserved()
    assert torch_neuronx.memory_stats()["allocated_bytes.all.current"] == base + x.nbytes
    assert "memory summary" in torch_neuronx.memory_summary()
    del x
    torch_neuronx.reset_peak_memory_stats()
    assert torch_neuronx.max_memory_allocated() == base
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "reset_peak_memory_stats", "memory_stats",
                 "memory_summary"):
        assert getattr(torch_neuronx, name) is getattr(torch.neuron, name)
