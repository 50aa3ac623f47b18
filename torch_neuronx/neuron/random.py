"""RNG APIs of ``torch.neuron``: one Mersenne Twister per device, CPU's algorithm, so a seed
gives the same numbers as on CPU."""
from __future__ import annotations

import torch

from .. import _C
from ._device import _index, device_count

_generators: dict = {}


def _generator(device=None) -> torch.Generator:
    idx = _index(device)
    gen = _generators.get(idx)
    if gen is None:
        gen = _generators[idx] = _C._default_generator(idx)
    return gen


def default_generator(device=None) -> torch.Generator:
    return _generator(device)


def get_rng_state(device="neuron") -> torch.Tensor:
    return _generator(device).get_state()


def get_rng_state_all() -> list:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state(new_state: torch.Tensor, device="neuron") -> None:
    _generator(device).set_state(new_state.cpu())


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    _generator(None).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _generator(i).manual_seed(int(seed))


def seed() -> None:
    _generator(None).seed()


def seed_all() -> None:
    s = _generator(0).seed() if device_count() else None
    for i in range(1, device_count()):
        _generator(i).manual_seed(s)


def initial_seed() -> int:
    return _generator(None).initial_seed()
