"""TorchTitan's own device detection on neuron (run by `make test-torchtitan`, which installs
TorchTitan; the default set skips it): the device it picks, its MFU peak-FLOPs table and its
memory monitor, each against what the device reports."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")


def test_torchtitan_picks_neuron_and_the_modelled_peak():
    from torchtitan.components.metrics import DeviceMemoryMonitor
    from torchtitan.tools import utils

    assert utils.device_type == "neuron" and utils.device_module is torch.neuron
    peak = utils.get_peak_flops(torch.neuron.get_device_name())
    assert peak == pytest.approx(torch.neuron.get_device_properties().peak_tflops["bfloat16"] * 1e12)
    monitor = DeviceMemoryMonitor("neuron:0")
    assert monitor.device_name == "neuron"
    assert monitor.device_capacity == torch.neuron.get_device_properties(0).total_memory
    x = torch.empty(1 << 20, device="neuron")
    stats = monitor.get_peak_stats()
    assert stats.max_reserved_gib >= x.nbytes / 2**30 and stats.num_ooms == 0
