"""``torch.neuron.make_graphed_callables``: CUDA's partial-network capture on neuron, built on
the device's graph capture (graphs.py): a callable's forward and its backward become two
graphs, run by one autograd node."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .graphs import NeuronGraph, graph, graph_pool_handle


def make_graphed_callables(callables, sample_args, num_warmup_iters=3, allow_unused_input=False,
                           pool=None):
    """``torch.cuda.make_graphed_callables`` for neuron: each callable (a function or an
    ``nn.Module``) comes back with its forward captured as one graph and its backward as
    another, run by a single autograd node. Inputs are copied into the captured (static) ones
    at each call, outputs are the static outputs, detached. A module's forward is replaced
    while it is in training mode, as CUDA's does; in eval mode it runs eagerly."""
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    if len(callables) != len(sample_args):
        raise ValueError(f"make_graphed_callables: {len(callables)} callables but "
                         f"{len(sample_args)} tuples of sample args")
    pool = graph_pool_handle() if pool is None else pool
    out = []
    for fn, args in zip(callables, sample_args):
        args = tuple(args)
        if not all(isinstance(a, torch.Tensor) for a in args):
            raise TypeError("make_graphed_callables: sample_args may hold only Tensors, got "
                            f"{[type(a).__name__ for a in args]}")
        params = ()
        if isinstance(fn, torch.nn.Module):
            if fn._backward_hooks or fn._forward_hooks or fn._forward_pre_hooks:
                raise RuntimeError("make_graphed_callables: modules must not have hooks registered "
                                   "when they are graphed (the hooks would run only at capture)")
            bad = [n for n, b in fn.named_buffers() if b.requires_grad]
            if bad:
                raise RuntimeError(f"make_graphed_callables: buffers {bad} require grad; in a "
                                   "graphed module only parameters may be trainable")
            params = tuple(p for p in fn.parameters() if p.requires_grad)
        out.append(_graph_one(fn, args, params, num_warmup_iters, allow_unused_input, pool))
    return out[0] if single else tuple(out)


def _graph_one(fn, args, params, warmup, allow_unused, pool):
    inputs = args + params
    needs = [t for t in inputs if t.requires_grad]

    def grads_of(outs, grad_outs):
        diff = [(o, g) for o, g in zip(outs, grad_outs) if o.requires_grad]
        return torch.autograd.grad([o for o, _ in diff], needs, grad_outputs=[g for _, g in diff],
                                   only_inputs=True, allow_unused=allow_unused)

    side = torch.neuron.Stream()
    side.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(side):  # warm-up: lazy state built before capture, as on CUDA
        for _ in range(warmup):
            outs = tree_flatten(fn(*args))[0]
            if needs:
                grads_of(outs, [torch.empty_like(o) for o in outs])
    torch.neuron.current_stream().wait_stream(side)

    fwd = NeuronGraph()
    with graph(fwd, pool=pool):
        static_out = fn(*args)
    flat_out, spec = tree_flatten(static_out)
    static_grad_out = [torch.empty_like(o) if o.requires_grad else None for o in flat_out]
    bwd = NeuronGraph()
    with graph(bwd, pool=pool):
        grads = grads_of(flat_out, static_grad_out) if needs else ()
    it = iter(grads)
    static_grad_in = [next(it) if t.requires_grad else None for t in inputs]
    n_args = len(args)

    class _Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *given):
            for static, new in zip(args, given[:n_args]):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
            fwd.replay()
            return tuple(o.detach() for o in flat_out)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grad_outs):
            for static, g in zip(static_grad_out, grad_outs):
                if static is not None:
                    if g is None:
                        static.zero_()
                    elif static.data_ptr() != g.data_ptr():
                        static.copy_(g)
            bwd.replay()
            return tuple(g.detach() if g is not None else None for g in static_grad_in)

    def graphed(*user_args):
        if len(user_args) != n_args:
            raise TypeError(f"graphed callable takes {n_args} tensor arguments, got {len(user_args)}")
        return tree_unflatten(list(_Graphed.apply(*(tuple(user_args) + params))), spec)

    if isinstance(fn, torch.nn.Module):
        eager_forward = fn.forward

        def forward(*user_args):
            return graphed(*user_args) if fn.training else eager_forward(*user_args)
        fn.forward = forward
        return fn
    return graphed
