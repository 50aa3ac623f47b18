"""The fused LSTM and GRU cells CUDA has and CPU lacks."""
from __future__ import annotations

import torch

_lib = torch.library.Library("aten", "IMPL")


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


# nn.GRUCell / nn.LSTMCell (aten::gru_cell, lstm_cell): CPU's composite, op for op, so a cell
# step and its autograd graph equal CPU's bit for bit. Off the CPU, ATen's composite would
# take the fused cells above, whose bias add and backward round differently from CPU's
# linear-with-bias and its autograd; a recurrent model (a world model's RSSM) then drifts
# from CPU by an ulp per step. The multi-step modules (nn.GRU/nn.LSTM) keep the fused cells.
_autograd_lib = torch.library.Library("aten", "IMPL")


def _gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    ig = torch.nn.functional.linear(input, w_ih, b_ih).unsafe_chunk(3, 1)
    hg = torch.nn.functional.linear(hx, w_hh, b_hh).unsafe_chunk(3, 1)
    reset = hg[0].add_(ig[0]).sigmoid_()
    update = hg[1].add_(ig[1]).sigmoid_()
    new = ig[2].add(hg[2].mul_(reset)).tanh_()
    return (hx - new).mul_(update).add_(new)


def _lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    h, c = hx
    gates = torch.nn.functional.linear(h, w_hh, b_hh).add_(torch.nn.functional.linear(input, w_ih, b_ih))
    i, f, g, o = gates.unsafe_chunk(4, 1)
    i, f, g, o = i.sigmoid_(), f.sigmoid_(), g.tanh_(), o.sigmoid_()
    cy = (f * c).add_(i * g)
    return o * cy.tanh(), cy


_autograd_lib.impl("gru_cell", _gru_cell, "AutogradPrivateUse1")
_autograd_lib.impl("lstm_cell", _lstm_cell, "AutogradPrivateUse1")
