import torch


def test_autoload_registers_neuron():
    assert torch._C._get_privateuse1_backend_name() == "neuron"
    assert torch.accelerator.current_accelerator() == torch.device("neuron")


def test_roundtrip_matches_cpu():
    x = torch.randn(8, 8)
    y = x.to("neuron")
    assert y.is_neuron and y.device == torch.device("neuron", 0)
    torch.testing.assert_close((y @ y).relu().cpu(), (x @ x).relu(), rtol=0, atol=0)
