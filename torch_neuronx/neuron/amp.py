"""``torch.neuron.amp``: the deprecated ``torch.cuda.amp`` spellings, for programs ported from
CUDA by renaming the device. Each warns as CUDA's does and is ``torch.amp``'s on ``neuron``
(autocast's default dtype there is bfloat16, Trainium's native mixed precision)."""
from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["GradScaler", "autocast", "custom_bwd", "custom_fwd"]


class autocast(torch.amp.autocast):
    """``torch.amp.autocast("neuron", ...)``."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype | None = None,
                 cache_enabled: bool = True):
        warnings.warn("torch.neuron.amp.autocast(args...) is deprecated. Please use "
                      "torch.amp.autocast('neuron', args...) instead.", FutureWarning,
                      stacklevel=2)
        super().__init__("neuron", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler("neuron", ...)``."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True):
        warnings.warn("torch.neuron.amp.GradScaler(args...) is deprecated. Please use "
                      "torch.amp.GradScaler('neuron', args...) instead.", FutureWarning,
                      stacklevel=2)
        super().__init__("neuron", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)


def custom_fwd(fwd=None, *, cast_inputs=None):
    """``torch.amp.custom_fwd(device_type="neuron", ...)``."""
    warnings.warn("torch.neuron.amp.custom_fwd(args...) is deprecated. Please use "
                  "torch.amp.custom_fwd(args..., device_type='neuron') instead.",
                  FutureWarning, stacklevel=2)
    return functools.partial(torch.amp.custom_fwd, device_type="neuron")(
        fwd=fwd, cast_inputs=cast_inputs)


def custom_bwd(bwd):
    """``torch.amp.custom_bwd(device_type="neuron")``."""
    warnings.warn("torch.neuron.amp.custom_bwd(args...) is deprecated. Please use "
                  "torch.amp.custom_bwd(args..., device_type='neuron') instead.",
                  FutureWarning, stacklevel=2)
    return torch.amp.custom_bwd(bwd, device_type="neuron")
