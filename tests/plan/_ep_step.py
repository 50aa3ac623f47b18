"""One training step of a small mixture-of-experts block on neuron: ``single`` (every expert
on one device) or ``ep`` (expert parallelism over WORLD_SIZE ranks, the "neuron" backend:
each rank holds EXPERTS / WORLD_SIZE experts; the routed tokens are dispatched with
``all_to_all_single`` after the per-expert counts are exchanged, as TorchTitan does, and
combined back with the reverse all_to_all; the non-expert parameters are data parallel, their
gradients all-reduced). Every rank feeds the same tokens, so the routing is the one-device
step's. ``epfsdp``: the same with FSDP2 over the ranks on the non-expert parameters.
``_ep_step.py single|ep|epfsdp``; prints the trace and the first
step's loss as JSON after "TRACE "."""
import json
import os
import sys

import torch
import torch.nn as nn

import torch_neuronx
from torch_neuronx import plan

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 96, 192, 4, 2, 128


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class MoE(nn.Module):
    """Router (top-k of a softmax), the experts, and the weighted combine. ``group``: the
    expert-parallel process group (None: every expert local)."""

    def __init__(self, group=None):
        super().__init__()
        # the block's input needs a gradient, as after any earlier layer: the trace tells an
        # expert's backward ops by that gradient (ModTracker ends a module's backward there)
        self.proj = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.group = group

    def forward(self, x):
        x = self.proj(x)
        probs = self.router(x).softmax(-1)
        w, ids = probs.topk(TOP_K, dim=-1)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        tok = order // TOP_K
        xs = x[tok]                              # tokens sorted by expert
        counts = torch.bincount(flat, minlength=EXPERTS)
        if self.group is None:
            chunks = xs.split(counts.tolist())
            ys = torch.cat([e(c) for e, c in zip(self.experts, chunks)])
        else:
            ys = self._dispatch(xs, counts)
        return x.new_zeros(x.shape).index_add_(0, tok, ys * w.reshape(-1)[order, None])

    def _dispatch(self, xs, counts):
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single
        n = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        local = EXPERTS // n
        got = torch.empty_like(counts)          # got[s * local + j]: rank s's tokens for j
        dist.all_to_all_single(got, counts, group=self.group)
        send = counts.view(n, local).sum(1).tolist()
        got = got.tolist()
        recv = [sum(got[s * local:(s + 1) * local]) for s in range(n)]
        rx = all_to_all_single(xs.new_empty(sum(recv), xs.shape[1]), xs, recv, send,
                               group=self.group)
        # the received tokens, by source rank then local expert: each expert runs on each
        # source's chunk (no regrouping copy)
        chunks = rx.split(got)
        outs = [self.experts[rank * local + i % local](c) for i, c in enumerate(chunks)]
        ry = torch.cat(outs)
        return all_to_all_single(xs.new_empty(xs.shape), ry, send, recv, group=self.group)


def build(layout: str, dev, group=None):
    torch.manual_seed(0)
    model = MoE(group)
    if layout in ("ep", "epfsdp"):
        import torch.distributed as dist
        n, rank = dist.get_world_size(), dist.get_rank()
        local = EXPERTS // n
        # the experts this rank does not hold are dropped
        for i in range(EXPERTS):
            if not rank * local <= i < (rank + 1) * local:
                model.experts[i] = nn.Identity()
    model = model.to(dev)
    if layout == "epfsdp":
        # FSDP2 over the same ranks on the non-expert parameters (TorchTitan's dp_shard = ep),
        # the experts this rank holds left to expert parallelism
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, ignored_params=set(model.experts.parameters()))
    # two parameter groups, as DTensor's list ops refuse FSDP2's sharded parameters beside
    # plain ones
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts.")]
    experts = [p for n, p in model.named_parameters() if n.startswith("experts.")]
    return model, torch.optim.SGD([{"params": dense}, {"params": experts}], lr=0.01)


def traced_step(layout: str, dev):
    import torch.distributed as dist
    model, opt = build(layout, dev, dist.group.WORLD if layout in ("ep", "epfsdp") else None)
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(0)).to(dev)
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts.")]

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        if layout == "ep":
            for p in dense:   # data parallel over the non-expert parameters
                dist.all_reduce(p.grad)
        opt.step()
        return loss

    first = step().item()   # of the initial parameters
    step()
    with plan.trace(dev, model, opt if layout == "single" else None) as t:
        step()
    return t, first


def main():
    layout = sys.argv[1]
    torch_neuronx.set_adaptive_eager(False)   # as _replay_step: the replay prices op by op
    rank = int(os.environ.get("RANK", "0"))
    if layout in ("ep", "epfsdp"):
        import torch.distributed as dist
        dist.init_process_group("neuron")
    dev = torch.device("neuron", rank)
    torch.neuron.set_device(dev)
    t, first = traced_step(layout, dev)
    out = {"loss": first, "seconds": t.seconds, "flops": t.flops, "collectives": t.collectives,
           "memory_peak": t.memory_peak, "memory_start": t.memory_start,
           "ops": [[o.charge.name, o.charge.count, o.charge.seconds,
                    [list(s) for s in o.charge.shapes or ()], o.module, o.backward,
                    o.charge.bytes_in, o.charge.bytes_out] for o in t.ops]}
    print("TRACE " + json.dumps(out), flush=True)
    if layout in ("ep", "epfsdp"):
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
