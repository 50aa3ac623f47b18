"""What the cost model charged while a function ran on the device (tests of routed kernels)."""
import torch

from torch_neuronx import cost_model


def charges(fn):
    """(result, [OpCharge] of everything fn ran on the device)."""
    torch.neuron.synchronize()
    cost_model._drain()
    seen = []
    cost_model._op_listeners.append(seen.append)
    try:
        out = fn()
        torch.neuron.synchronize()
        cost_model._drain()
    finally:
        cost_model._op_listeners.remove(seen.append)
    return out, seen
