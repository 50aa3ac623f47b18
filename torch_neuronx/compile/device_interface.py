"""Dynamo's ``DeviceInterface`` for the neuron device.

Dynamo and Inductor ask this interface (``torch._dynamo.device_interface``) for the current
device, streams, events and properties of any device a graph runs on; without it Inductor
cannot compile a graph whose tensors live on ``neuron``. Everything forwards to
``torch.neuron``, the device module.
"""
from __future__ import annotations

import torch
from torch._dynamo.device_interface import DeviceInterface


class NeuronInterface(DeviceInterface):
    """Dynamo/Inductor view of ``torch.neuron`` (a virtual Trainium NeuronCore)."""

    class device(torch.neuron.device):  # type: ignore[name-defined]
        pass

    # torch.Event / torch.Stream subclasses, as Dynamo requires to trace them.
    Event = torch.neuron.Event  # type: ignore[attr-defined]
    Stream = torch.neuron.Stream  # type: ignore[attr-defined]

    class Worker:
        # Device memory is host memory and the device is a host-side runtime, so a
        # compile worker process can ask the same module (no fork hazards as with CUDA).
        @staticmethod
        def set_device(device: int) -> None:
            torch.neuron.set_device(device)

        @staticmethod
        def current_device() -> int:
            return torch.neuron.current_device()

        @staticmethod
        def get_device_properties(device=None):
            return torch.neuron.get_device_properties(device)

    @staticmethod
    def current_device() -> int:
        return torch.neuron.current_device()

    @staticmethod
    def set_device(device) -> None:
        torch.neuron.set_device(device)

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        prev = torch.neuron.current_device()
        if device >= 0 and device != prev:
            torch.neuron.set_device(device)
        return prev

    @staticmethod
    def exchange_device(device: int) -> int:
        prev = torch.neuron.current_device()
        torch.neuron.set_device(device)
        return prev

    @staticmethod
    def device_count() -> int:
        return torch.neuron.device_count()

    @staticmethod
    def is_available() -> bool:
        return torch.neuron.is_available()

    @staticmethod
    def stream(stream):
        return torch.neuron.stream(stream)

    @staticmethod
    def current_stream():
        return torch.neuron.current_stream()

    @staticmethod
    def set_stream(stream) -> None:
        torch.neuron.set_stream(stream)

    @staticmethod
    def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        torch.neuron.set_stream(torch.Stream(stream_id=stream_id, device_index=device_index,
                                             device_type=device_type))

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        # Generated C++ kernels run on the host thread and take no stream handle.
        return 0

    @staticmethod
    def synchronize(device=None) -> None:
        torch.neuron.synchronize(device)

    @classmethod
    def get_device_properties(cls, device=None):
        return torch.neuron.get_device_properties(device)

    @staticmethod
    def get_compute_capability(device=None) -> str:
        major, minor = torch.neuron.get_device_capability(device)
        return f"{major}{minor}"

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def is_dtype_supported(dtype, including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def memory_allocated(device=None) -> int:
        return torch.neuron.memory_allocated(device)

    @staticmethod
    def is_triton_capable(device=None) -> bool:
        # Code generation is Inductor's C++ backend; Triton does not target this device.
        return False

    @staticmethod
    def raise_if_triton_unavailable(device=None) -> None:
        raise RuntimeError("the neuron device compiles with Inductor's C++ code generation, "
                           "not Triton")
