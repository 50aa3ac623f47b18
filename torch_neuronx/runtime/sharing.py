"""Neuron tensors through ``torch.multiprocessing``, shared as CUDA's are.

Device memory is host memory, so a neuron tensor is shared the way CPU tensors are: on its
first trip to another process its buffer moves into a shared-memory CPU storage (the device
keeps using it in place, counted as before), and the receiving process adopts that storage
as a buffer of the same device index. Writes on either side are seen by the other, as with
CUDA IPC. The sender waits for its queued work before the tensor leaves (CUDA records an
event the receiver waits on; a synchronize gives the same order). Without this, torch's CPU
reducer failed in the queue's feeder thread (``_share_fd_: only available on CPU``) and the
receiver waited forever.
"""
from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions as _torch_reductions

from .. import _C


def _rebuild_neuron_tensor(cls, cpu, device_index, requires_grad):
    t = _C._adopt_tensor(cpu, device_index)
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad)


def _reduce_tensor(t):
    if t.device.type != "neuron":
        return _torch_reductions.reduce_tensor(t)
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since "
            "autograd does not support crossing process boundaries.  If you just want to "
            "transfer the data, call detach() on the tensor before serializing (e.g., "
            "putting it on the queue).")
    shm = _C._shared_cpu_storage(t)
    if shm is None or not shm.untyped_storage().is_shared():
        shm = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8).share_memory_()
        _C._move_to_shared(t, shm)
    torch.neuron.synchronize(t.device)
    cpu = torch.empty(0, dtype=t.dtype).set_(shm.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return _rebuild_neuron_tensor, (type(t), cpu, t.device.index, t.requires_grad)


def _install():
    # torch registered its reducers for these classes at import; neuron tensors take ours,
    # every other tensor still takes torch's.
    ForkingPickler.register(torch.Tensor, _reduce_tensor)
    ForkingPickler.register(torch.nn.parameter.Parameter, _reduce_tensor)


_install()
