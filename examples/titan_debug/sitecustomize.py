"""TorchTitan 0.3.0 was written against a newer torch than 2.13: after its first step it calls
``torch.distributed.set_timeout(timeout, group)``, which torch 2.13 has only under its private
name ``_set_pg_timeout``. That is a torch version gap, not a device one (a CUDA run on torch 2.13
stops at the same call), so this file, put on PYTHONPATH for the run, gives torch the public
name. Nothing of TorchTitan's or of torch's behaviour is changed."""
import torch.distributed as _dist

if not hasattr(_dist, "set_timeout"):
    from torch.distributed.distributed_c10d import _set_pg_timeout as _set_pg_timeout

    _dist.set_timeout = _set_pg_timeout
