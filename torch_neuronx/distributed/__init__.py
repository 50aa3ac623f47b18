"""Distributed training on neuron devices: the "neuron" c10d backend.

``import torch`` registers the backend (see ``_register``), so under torchrun::

    dist.init_process_group(backend="neuron")   # or no backend: neuron is the accelerator's
    mesh = init_device_mesh("neuron", (2, 2), mesh_dim_names=("dp", "tp"))

Each rank runs on ``neuron:LOCAL_RANK``. Collectives move bytes with gloo over TCP on
zero-copy aliases of device memory and add NeuronLink/EFA time to the modelled device time
(``collectives_model``). See docs/distributed.md.
"""
from __future__ import annotations

__all__ = ["ProcessGroupNeuron", "collective_seconds", "is_neuron_backend_available"]


def _create_backend(dist_backend_opts, backend_options=None):
    # Imported on first use so ``import torch`` stays fast.
    from .process_group import _create
    return _create(dist_backend_opts, backend_options)


def _register() -> None:
    """Register "neuron" with c10d for neuron and cpu tensors (called at import of
    torch_neuronx; only touches torch.distributed, which ``import torch`` already loaded)."""
    import torch.distributed as dist
    if not dist.is_available() or "neuron" in dist.Backend.backend_list:
        return
    # devices must be a list: a string would be iterated by character.
    dist.Backend.register_backend("neuron", _create_backend, extended_api=True,
                                  devices=["neuron", "cpu"])


def is_neuron_backend_available() -> bool:
    import torch.distributed as dist
    return dist.is_available() and "neuron" in dist.Backend.backend_list


def __getattr__(name):
    if name == "ProcessGroupNeuron":
        from .process_group import ProcessGroupNeuron
        return ProcessGroupNeuron
    if name == "collective_seconds":
        from .collectives_model import collective_seconds
        return collective_seconds
    raise AttributeError(f"module 'torch_neuronx.distributed' has no attribute {name!r}")
