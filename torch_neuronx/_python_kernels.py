"""Kernels registered from Python for ops the CPU fallback cannot serve as CUDA does.

The fallback hands a random op the device's generator through the op's ``Generator?``
argument. ``aten::native_dropout`` has none, so its CPU kernel would draw from the CPU
default generator: ``torch.neuron.manual_seed`` would not reach dropout and dropout would
advance CPU's stream, unlike CUDA, where dropout draws from the device's generator. This
kernel performs the CPU kernel's steps (a Bernoulli mask of the keep probability, then
``input * mask * scale``) with ``bernoulli_`` on the device, which the fallback routes to
the neuron generator, so a seed gives CPU's numbers and only the device stream advances.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("aten", "IMPL")


def _native_dropout(input: torch.Tensor, p: float, train):
    if input.numel() == 0:
        return input, torch.empty_like(input)  # as CPU: the empty mask keeps the input dtype
    if train is None or train:
        p1m = 1.0 - p
        scale = 0.0 if p1m == 0 else 1.0 / p1m
        mask = torch.empty_like(input, memory_format=torch.contiguous_format)
        mask.bernoulli_(p1m)
        output = input.mul(mask).mul_(scale)
        return output, mask.to(torch.bool)
    return input.clone(), torch.ones_like(input, dtype=torch.bool)


_lib.impl("native_dropout", _native_dropout, "PrivateUse1")


# Quantized tensors: PyTorch's eager quantization (torch.ao.quantization) is deprecated
# upstream and has no PrivateUse1 storage, so the CPU fallback fails deep in empty_strided.
# These name the op and the way forward instead.
def _no_quantized(op):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"aten::{op} is not supported on the neuron device: eager quantized tensors "
            "(torch.ao.quantization, deprecated upstream) have no neuron storage. Quantize on "
            "the CPU, or keep low-precision weights as ordinary neuron tensors "
            "(float8/int8 dtypes) with explicit scales.")
    return kernel


for _op in ("quantize_per_tensor", "quantize_per_tensor.tensor_qparams",
            "quantize_per_tensor.tensors", "quantize_per_tensor_dynamic", "quantize_per_channel"):
    _lib.impl(_op, _no_quantized(_op), "PrivateUse1")


# Fused RNN cells. Off the CPU, nn.LSTM/nn.GRU (and their cells) compute the two gate matmuls
# without bias and call these fused cells, as on CUDA, where CPU has no kernel. The math is
# CUDA's cell (PyTorch's documented LSTM/GRU equations, gate order i,f,g,o and r,z,n); the
# workspace holds what the backward needs, laid out as CUDA's: activated gates (LSTM) and
# r, z, n, hx, hidden n-gate with bias (GRU).
def _gates(gates, bias):
    return gates if bias is None else gates + bias


def _fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = _gates(input_gates, input_bias) + _gates(hidden_gates, hidden_bias)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def _fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = workspace.chunk(4, 1)
    tcy = cy.tanh()
    if grad_hy is not None:
        go = grad_hy * tcy
        gc = grad_hy * o * (1 - tcy * tcy)
    else:
        go = torch.zeros_like(cy)
        gc = torch.zeros_like(cy)
    if grad_cy is not None:
        gc = gc + grad_cy
    grad_gates = torch.cat([gc * g * i * (1 - i), gc * cx * f * (1 - f),
                            gc * i * (1 - g * g), go * o * (1 - o)], 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, gc * f, grad_bias


def _fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ir, iz, in_ = _gates(input_gates, input_bias).chunk(3, 1)
    hr, hz, hn = _gates(hidden_gates, hidden_bias).chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hx, hn], 1)


def _fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = workspace.chunk(5, 1)
    gz = grad_hy * (hx - n) * z * (1 - z)
    gn = grad_hy * (1 - z) * (1 - n * n)
    gr = gn * hn * r * (1 - r)
    grad_input_gates = torch.cat([gr, gz, gn], 1)
    grad_hidden_gates = torch.cat([gr, gz, gn * r], 1)
    if has_bias:
        return (grad_input_gates, grad_hidden_gates, grad_hy * z,
                grad_input_gates.sum(0), grad_hidden_gates.sum(0))
    return grad_input_gates, grad_hidden_gates, grad_hy * z, None, None


_lib.impl("_thnn_fused_lstm_cell", _fused_lstm_cell, "PrivateUse1")
_lib.impl("_thnn_fused_lstm_cell_backward_impl", _fused_lstm_cell_backward_impl, "PrivateUse1")
_lib.impl("_thnn_fused_gru_cell", _fused_gru_cell, "PrivateUse1")
_lib.impl("_thnn_fused_gru_cell_backward", _fused_gru_cell_backward, "PrivateUse1")
