"""A small GPT shared by the distributed tests and bench/bench_distributed.py, written with
the module names tensor-parallel plans use (attention.wq/wk/wv/wo, feed_forward.w1/w2)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Token embedding, causal blocks, final norm, head. No position embedding: the causal
    mask orders tokens, and a sequence-sharded activation needs nothing position-wise."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def batch(step: int, n: int, seq: int, vocab: int = 64):
    """Deterministic token batch ``step`` of ``n`` sequences (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def tp_plan(sequence_parallel: bool = True) -> tuple:
    """(plan for the GPT root, plan for each block) in torchtitan's style."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    if sequence_parallel:
        root = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        block = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate())}
        block = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                 "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                 "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    return root, block


def apply_tp(model: GPT, mesh, sequence_parallel: bool = True) -> GPT:
    from torch.distributed.tensor.parallel import parallelize_module
    root, block = tp_plan(sequence_parallel)
    for layer in model.layers:
        parallelize_module(layer, mesh, block)
    parallelize_module(model, mesh, root)
    return model


def reference_train(steps: int, n: int, seq: int, lr: float = 0.05, clip=None, seed: int = 0,
                    layers: int = 2, opt: str = "sgd"):
    """Single-process CPU training: (losses, final state_dict) - what every parallel run must
    reproduce."""
    torch.manual_seed(seed)
    model = GPT(layers=layers)
    optim = make_optim(model.parameters(), lr, opt)
    losses = []
    for step in range(steps):
        x, y = batch(step, n, seq)
        loss = lm_loss(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_optim(params, lr, opt):
    if opt == "adam":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
