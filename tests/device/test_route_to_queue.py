"""``_C._route_to_queue``: another library's op whose only kernels are catch-all or composite
(vLLM's CPU attention ops) runs on the device's queue through the fallback, in order with the
work before it; a library's own PrivateUse1 kernel is never replaced."""
from __future__ import annotations

import pytest
import torch

import torch_neuronx
from torch_neuronx import _C

N = "neuron"
_lib = torch.library.Library("neuron_route_test", "DEF")
_lib.define("scale_into(Tensor x, Tensor(a!) out, float s) -> ()")
_lib.define("tagged(Tensor x) -> Tensor")


def _scale_into(x, out, s):
    out.copy_(x * s)


_lib.impl("scale_into", _scale_into, "CompositeExplicitAutograd")
_lib.impl("tagged", lambda x: x + 1, "CompositeImplicitAutograd")
_lib.impl("tagged", lambda x: x + 100, "PrivateUse1")


def test_routed_op_is_queued_in_order_and_equals_cpu():
    x = torch.randn(4096, device=N)
    out = torch.empty_like(x)
    _C._route_to_queue("neuron_route_test::scale_into")
    _C._route_to_queue("neuron_route_test::scale_into")      # a second call changes nothing
    torch.neuron.synchronize()
    torch_neuronx.queue_stats(reset=True)
    y = x * 2                                                # queued before the routed op
    for s in (1.5, 3.0):
        torch.ops.neuron_route_test.scale_into(y, out, s)
    assert torch_neuronx.queue_stats(reset=True)["synchronous_ops"] == {}
    torch.testing.assert_close(out.cpu(), x.cpu() * 2 * 3.0, rtol=0, atol=0)


def test_a_librarys_own_neuron_kernel_is_kept():
    x = torch.zeros(3, device=N)
    _C._route_to_queue("neuron_route_test::tagged")
    assert torch.ops.neuron_route_test.tagged(x).cpu().tolist() == [100.0] * 3
    assert torch.ops.neuron_route_test.tagged(x.cpu()).tolist() == [1.0] * 3


@pytest.mark.parametrize("name,match", [("scale_into", "namespace::op"),
                                        ("neuron_route_test::nope", "no operator")])
def test_bad_names_are_refused(name, match):
    with pytest.raises(ValueError, match=match):
        _C._route_to_queue(name)
