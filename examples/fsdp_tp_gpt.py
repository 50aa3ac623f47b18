"""FSDP2 + tensor parallel training of a small GPT on 4 neuron ranks (a 2 x 2 device mesh).

    torchrun --nproc-per-node 4 examples/fsdp_tp_gpt.py [--steps 20]

The mesh's "dp" dimension shards parameters, gradients and optimizer state with FSDP2
(``fully_shard``, bf16 compute, fp32 gradient reduction); the "tp" dimension splits every
attention and MLP matmul Megatron-style and shards activations along the sequence between
them (sequence parallel). Each rank runs on neuron:LOCAL_RANK; collectives use the "neuron"
c10d backend, and the modelled Trainium time includes NeuronLink time for them.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t = x.shape[:2]
        # -1: under tensor parallelism each rank holds only its share of the heads
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = nn.Sequential()
        self.feed_forward.w1 = nn.Linear(dim, 4 * dim)
        self.feed_forward.act = nn.GELU()
        self.feed_forward.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, dim=128, heads=4, layers=4):
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


def parallelize(model: GPT, mesh) -> GPT:
    tp, dp = mesh["tp"], mesh["dp"]
    # Tensor + sequence parallel on "tp": activations between blocks are sharded on the
    # sequence dim (Shard(1)); attention and MLP gather them, split their matmuls by column
    # then by row, and reduce-scatter back to sequence shards.
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    # FSDP2 on "dp": one all-gather per block in forward, a reduce-scatter in backward.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank")
    args = ap.parse_args()

    dist.init_process_group("neuron")              # device = neuron:LOCAL_RANK
    mesh = init_device_mesh("neuron", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)                            # same initial weights on every rank
    model = parallelize(GPT().to("neuron"), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()

    import torch_neuronx
    torch_neuronx.reset_modelled_time()
    for step in range(args.steps):
        # a learnable toy task: predict the next token of sequences counting modulo 256
        g = torch.Generator().manual_seed(step)
        start = torch.randint(0, 256, (args.batch * dp_size, 1), generator=g)
        data = (start + torch.arange(args.seq + 1)) % 256
        data = data.chunk(dp_size)[dp_rank].to("neuron")   # tp peers see the same batch
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            avg = loss.detach().clone()
            dist.all_reduce(avg, op=dist.ReduceOp.AVG)
            if dist.get_rank() == 0:
                print(f"step {step:3d}  loss {avg.item():.4f}", flush=True)
    t = torch_neuronx.modelled_time()
    if dist.get_rank() == 0:
        comm = t.by_engine.get("collective", 0.0)
        print(f"rank 0 on neuron:{torch.neuron.current_device()} (LOCAL_RANK={os.environ.get('LOCAL_RANK')}): "
              f"modelled trn2 time {t.seconds * 1e3:.2f} ms, of which collectives {comm * 1e3:.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
