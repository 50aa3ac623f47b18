"""The neuron generator's state as AWS documents it (16 bytes: an 8-byte seed, then an 8-byte
offset), over CPU's Mersenne Twister: the offset is the word of the CPU stream, checked against
CPU generators that drew that many fp32 uniforms (one 32-bit word each)."""
from __future__ import annotations

import pytest
import torch

N = "neuron"


def _state(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


def _unpack(state: torch.Tensor) -> tuple:
    seed, offset = state.view(torch.int64).tolist()
    return seed, offset


def test_state_is_sixteen_bytes_seed_then_offset():
    torch.neuron.manual_seed(1234)
    s = torch.neuron.get_rng_state()
    assert s.dtype == torch.uint8 and s.shape == (16,) and s.device.type == "cpu"
    assert _unpack(s) == (1234, 0)
    torch.rand(1000, device=N)
    assert _unpack(torch.neuron.get_rng_state()) == (1234, 1000)


@pytest.mark.parametrize("offset", [0, 1, 623, 624, 625, 1248, 1249, 5000, 100003])
def test_offset_is_the_word_of_cpus_stream(offset):
    torch.neuron.set_rng_state(_state(77, offset))
    got = torch.rand(700, device=N).cpu()
    g = torch.Generator().manual_seed(77)
    torch.rand(offset, generator=g)
    assert torch.equal(got, torch.rand(700, generator=g))
    assert _unpack(torch.neuron.get_rng_state()) == (77, offset + 700)


@pytest.mark.parametrize("draw", [
    lambda: torch.rand(3000, device=N),
    lambda: torch.randn(37, device=N),
    lambda: torch.randn(3, device=N),          # leaves a cached normal sample behind
    lambda: torch.randn(5, dtype=torch.float64, device=N),
    lambda: torch.nn.functional.dropout(torch.ones(999, device=N), 0.3),
], ids=["rand", "randn37", "randn3", "randn_f64", "dropout"])
def test_save_and_restore_continue_exactly(draw):
    torch.neuron.manual_seed(9)
    draw()
    saved = torch.neuron.get_rng_state()
    a = [torch.randn(3, device=N).cpu(), torch.rand(50, device=N).cpu()]
    torch.neuron.set_rng_state(saved)
    b = [torch.randn(3, device=N).cpu(), torch.rand(50, device=N).cpu()]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_sequence_equals_cpu_after_restore():
    torch.neuron.manual_seed(3)
    torch.manual_seed(3)
    ref = torch.Generator().manual_seed(3)
    torch.randn(100, device=N), torch.randn(100, generator=ref)
    s = torch.neuron.get_rng_state()
    torch.rand(10_000, device=N)
    torch.neuron.set_rng_state(s)
    assert torch.equal(torch.rand(64, device=N).cpu(), torch.rand(64, generator=ref))


def test_generator_offset_api_and_clone():
    g = torch.Generator(device=N).manual_seed(5)
    assert g.get_offset() == 0 and g.initial_seed() == 5
    torch.rand(1300, device=N, generator=g)
    assert g.get_offset() == 1300
    g.set_offset(40)
    ref = torch.Generator().manual_seed(5)
    torch.rand(40, generator=ref)
    assert torch.equal(torch.rand(8, device=N, generator=g).cpu(), torch.rand(8, generator=ref))
    s = g.get_state()
    assert s.numel() == 16 and _unpack(s) == (5, 48)


def test_cpu_format_state_is_accepted():
    torch.manual_seed(11)
    torch.rand(2000)
    cpu_state = torch.get_rng_state()
    torch.neuron.set_rng_state(cpu_state)
    assert _unpack(torch.neuron.get_rng_state()) == (11, 2000)
    assert torch.equal(torch.rand(30, device=N).cpu(), torch.rand(30))


def test_bad_state_is_a_clear_error_and_the_generator_still_works():
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.neuron.set_rng_state(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(RuntimeError):
        torch.neuron.set_rng_state(torch.zeros(7, dtype=torch.uint8))
    torch.neuron.manual_seed(2)
    assert torch.equal(torch.rand(4, device=N).cpu(), torch.rand(4, generator=torch.Generator().manual_seed(2)))


def test_per_device_states_and_fork_rng():
    torch.neuron.manual_seed_all(4)
    torch.rand(10, device="neuron:1")
    assert _unpack(torch.neuron.get_rng_state(0)) == (4, 0)
    assert _unpack(torch.neuron.get_rng_state(1)) == (4, 10)
    with torch.random.fork_rng(device_type="neuron", devices=[0]):
        torch.rand(500, device=N)
    assert _unpack(torch.neuron.get_rng_state(0)) == (4, 0)
