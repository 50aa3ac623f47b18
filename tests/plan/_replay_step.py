"""One training step on neuron, traced, of a small MLP stack (``mlp``) or the demo GPT
(``gpt``): ``<model>-single`` on one device (per op, with the module each op ran under),
``<model>-fsdp`` (FSDP2 ``fully_shard`` on each of ``MODELS[model].fsdp_units``),
``<model>-hsdp`` (the same over a (WORLD_SIZE / HSDP_SHARD, HSDP_SHARD) mesh),
``<model>-fsdpmp``/``-hsdpmp`` (either with a bf16 MixedPrecisionPolicy), ``<model>-fsdptp``
(FSDP over "dp" and TP over "tp" of a (WORLD_SIZE / TP_2D, TP_2D) mesh) or
``<model>-tp`` (``parallelize_module`` with ``MODELS[model].tp_plan``) over WORLD_SIZE ranks.
Prints the traces as JSON after "TRACE ". Run as a rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in
the environment); single-device modes also run without them."""
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

import torch_neuronx
from torch_neuronx import plan
from torch_neuronx.demo.gpt import GPT, GPTConfig

DIM, BLOCKS, TOKENS = 256, 2, 128
GPT_CONFIG = GPTConfig(n_layer=2)
GPT_BATCH = 2
HSDP_SHARD = int(os.environ.get("HSDP_SHARD", "2"))   # the hsdp layouts' shard degree
TP_2D = 2


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class NormBlock(Block):
    """A pre-norm block, as a transformer's MLP half: the norm is what sequence parallelism
    shards."""
    def __init__(self, d):
        super().__init__(d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, d=DIM, n=BLOCKS, block=Block):
        super().__init__()
        self.blocks = nn.ModuleList(block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Attention(nn.Module):
    """TorchTitan's attention: four square projections, the head count taken from the local
    width (-1), so that a rank of a tensor-parallel run holds its share of the heads."""
    def __init__(self, d, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, t = x.shape[:2]
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class RotaryGQA(nn.Module):
    """Grouped-query attention (2 key/value heads for 4 query heads) with rotary position
    embeddings as Transformers' Llama applies them (rotate_half), the cos/sin tables given
    by the caller; the q, k, v and o projections square or narrower, the head count from the
    local width."""
    def __init__(self, d, head_dim=32, kv_heads=2):
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.wk, self.wv = (nn.Linear(d, kv_heads * head_dim, bias=False) for _ in range(2))

    def forward(self, x, cos, sin):
        b, t = x.shape[:2]
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))

        def rotate(z):
            half = z.shape[-1] // 2
            return z * cos + torch.cat((-z[..., half:], z[..., :half]), dim=-1) * sin
        y = torch.nn.functional.scaled_dot_product_attention(rotate(q), rotate(k), v,
                                                             is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class RotaryBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attention = RotaryGQA(d)
        self.feed_forward = Block(d)

    def forward(self, x, cos, sin):
        return self.feed_forward(x + self.attention(x, cos, sin))


class RotaryStack(nn.Module):
    """Two rotary GQA blocks; the rotary tables computed once, outside them (as Llama does)."""
    def __init__(self, d=128, head_dim=32):
        super().__init__()
        self.head_dim = head_dim
        self.blocks = nn.ModuleList(RotaryBlock(d) for _ in range(BLOCKS))

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        inv = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2, device=x.device) / self.head_dim)
        ang = torch.outer(pos, inv)
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos(), ang.sin()
        for b in self.blocks:
            x = b(x, cos, sin)
        return x


class AttnBlock(nn.Module):
    """Attention, then the MLP block, each with its residual (no norms: under TP without
    sequence parallelism their parameters would stay plain tensors beside DTensors, which
    DTensor's foreach optimizer refuses)."""
    def __init__(self, d, head_dim=32):
        super().__init__()
        self.attention = Attention(d, head_dim)
        self.feed_forward = Block(d)

    def forward(self, x):
        return self.feed_forward(x + self.attention(x))


class NormAttnBlock(AttnBlock):
    """Pre-norm: the norms are what sequence parallelism shards."""
    def __init__(self, d, head_dim=32):
        super().__init__(d, head_dim)
        self.attention_norm = nn.LayerNorm(d)
        self.feed_forward = NormBlock(d)

    def forward(self, x):
        return self.feed_forward(x + self.attention(self.attention_norm(x)))


@dataclass
class Workload:
    make: object        # () -> nn.Module
    batch: object       # (generator) -> inputs (CPU)
    loss: object        # (model, inputs on the device) -> loss
    tp_plan: dict | None
    fsdp_units: list
    optimizer: object = None   # (model) -> optimizer; None: SGD over every parameter


ATTN_PLAN = {f"blocks.{i}.{name}": style for i in range(BLOCKS)
             for name, style in (("attention.wq", "colwise"), ("attention.wk", "colwise"),
                                 ("attention.wv", "colwise"), ("attention.wo", "rowwise"),
                                 ("feed_forward.fc1", "colwise"), ("feed_forward.fc2", "rowwise"))}


def _llama():
    """A tiny Transformers Llama (GQA, rotary, RMSNorm), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=BLOCKS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


# Transformers' own tensor-parallel plan for Llama
LLAMA_PLAN = {f"model.layers.{i}.{name}": style for i in range(BLOCKS)
              for name, style in (("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
                                  ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"),
                                  ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
                                  ("mlp.down_proj", "rowwise"))}


def _split_groups(model, plan):
    """SGD over two parameter groups: the tensor-parallel Linears' (DTensors under TP) and
    the rest (plain tensors under TP: norms, embeddings, head), since DTensor's list ops
    refuse a list that mixes both."""
    tp = [p for n, p in model.named_parameters() if n.rpartition(".")[0] in plan]
    rest = [p for n, p in model.named_parameters() if n.rpartition(".")[0] not in plan]
    return torch.optim.SGD([{"params": tp}, {"params": rest}], lr=0.01)


def _compiled_blocks(model, blocks="blocks"):
    blocks = model.get_submodule(blocks)
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, backend="neuron", fullgraph=True)
    return model


def _gpt_batch(g):
    return torch.randint(0, GPT_CONFIG.vocab_size, (GPT_BATCH, GPT_CONFIG.block_size), generator=g)


MODELS = {
    "mlp": Workload(MLP, lambda g: torch.randn(TOKENS, DIM, generator=g),
                    lambda m, x: m(x).square().mean(),
                    {f"blocks.{i}.{name}": style for i in range(BLOCKS)
                     for name, style in (("fc1", "colwise"), ("fc2", "rowwise"))},
                    [f"blocks.{i}" for i in range(BLOCKS)] + [""]),
    # TP with sequence parallelism (TorchTitan's layout): "sequence" marks the norms
    "normmlp": Workload(lambda: MLP(block=NormBlock), lambda g: torch.randn(TOKENS, DIM, generator=g),
                        lambda m, x: m(x).square().mean(),
                        {f"blocks.{i}.{name}": style for i in range(BLOCKS)
                         for name, style in (("norm", "sequence"), ("fc1", "colwise"),
                                             ("fc2", "rowwise"))},
                        [f"blocks.{i}" for i in range(BLOCKS)] + [""]),
    # transformer blocks as TorchTitan writes them (batch 2 x 48 tokens, 4 heads of 32)
    "attn": Workload(lambda: MLP(d=128, block=AttnBlock),
                     lambda g: torch.randn(2, 48, 128, generator=g),
                     lambda m, x: m(x).square().mean(), ATTN_PLAN,
                     [f"blocks.{i}" for i in range(BLOCKS)] + [""]),
    # the same on 2 x 64 tokens: as many as the projections are wide, so each one's input
    # and weight gradients have the same shapes
    "attnsq": Workload(lambda: MLP(d=128, block=AttnBlock),
                       lambda g: torch.randn(2, 64, 128, generator=g),
                       lambda m, x: m(x).square().mean(), ATTN_PLAN,
                       [f"blocks.{i}" for i in range(BLOCKS)] + [""]),
    # grouped-query attention with rotary embeddings (Llama's rotate_half)
    "rotary": Workload(RotaryStack, lambda g: torch.randn(2, 48, 128, generator=g),
                       lambda m, x: m(x).square().mean(), ATTN_PLAN,
                       [f"blocks.{i}" for i in range(BLOCKS)] + [""]),
    # the same with a sequence as long as the key/value projections are wide (64): a
    # region's (batch, sequence, 64) shapes split on their features, not their sequence
    "rotaryseq": Workload(RotaryStack, lambda g: torch.randn(2, 64, 128, generator=g),
                          lambda m, x: m(x).square().mean(), ATTN_PLAN,
                          [f"blocks.{i}" for i in range(BLOCKS)] + [""]),
    # TorchTitan's layout of them: pre-norm, sequence parallel on dim 1 of (batch, sequence)
    "normattn": Workload(lambda: MLP(d=128, block=NormAttnBlock),
                         lambda g: torch.randn(2, 48, 128, generator=g),
                         lambda m, x: m(x).square().mean(),
                         {**ATTN_PLAN, **{f"blocks.{i}.{n}": "sequence" for i in range(BLOCKS)
                                          for n in ("attention_norm", "feed_forward.norm")}},
                         [f"blocks.{i}" for i in range(BLOCKS)] + [""]),
    # Transformers' Llama as users call it (keyword arguments, its own loss), FSDP2 on its
    # decoder layers and the root
    "llama": Workload(_llama, lambda g: torch.randint(0, 512, (2, 64), generator=g),
                      lambda m, x: m(input_ids=x, labels=x).loss, LLAMA_PLAN,
                      [f"model.layers.{i}" for i in range(BLOCKS)] + [""],
                      lambda m: _split_groups(m, LLAMA_PLAN)),
    # TorchTitan's per-block compile: each block wrapped by torch.compile (backend "neuron",
    # one graph per block) before FSDP2 shards it; the compiled graphs are charged to the
    # blocks, whose wrappers run their hooks eagerly
    "cmlp": Workload(lambda: _compiled_blocks(MLP()),
                     lambda g: torch.randn(TOKENS, DIM, generator=g),
                     lambda m, x: m(x).square().mean(), None,
                     [f"blocks.{i}" for i in range(BLOCKS)] + [""]),
    # the same with each decoder layer compiled on its own
    "cllama": Workload(lambda: _compiled_blocks(_llama(), "model.layers"),
                       lambda g: torch.randint(0, 512, (2, 64), generator=g),
                       lambda m, x: m(input_ids=x, labels=x).loss, None,
                       [f"model.layers.{i}" for i in range(BLOCKS)] + [""]),
    # AdamW with weight decay on the weights only, as training scripts group them: one
    # foreach op per group
    "mlpadamw": Workload(MLP, lambda g: torch.randn(TOKENS, DIM, generator=g),
                         lambda m, x: m(x).square().mean(),
                         {f"blocks.{i}.{name}": style for i in range(BLOCKS)
                          for name, style in (("fc1", "colwise"), ("fc2", "rowwise"))},
                         [f"blocks.{i}" for i in range(BLOCKS)] + [""],
                         lambda m: torch.optim.AdamW(
                             [{"params": [p for n, p in m.named_parameters()
                                          if n.endswith("weight")], "weight_decay": 0.1},
                              {"params": [p for n, p in m.named_parameters()
                                          if not n.endswith("weight")], "weight_decay": 0.0}],
                             lr=1e-3)),
    # FSDP only: a tensor-parallel GPT needs a head-aware plan for its fused qkv projection,
    # and an optimizer over DTensor and plain parameters at once is refused by DTensor.
    "gpt": Workload(lambda: GPT(GPT_CONFIG), _gpt_batch, lambda m, x: m(x, x)[1], None,
                    [f"blocks.{i}" for i in range(GPT_CONFIG.n_layer)] + [""]),
}


def _sequence_dim(w: Workload) -> int:
    return 0 if w.batch(torch.Generator()).dim() == 2 else 1


def build(model_name: str, layout: str, dev):
    """The model and its optimizer, laid out (``single``, ``fsdp`` or ``tp``)."""
    w = MODELS[model_name]
    torch.manual_seed(0)
    model = w.make().to(dev)
    if layout in ("fsdp", "hsdp", "fsdpmp", "hsdpmp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh, kw = None, {}
        if layout.endswith("mp"):
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        if layout.startswith("hsdp"):
            # HYBRID_SHARD as FSDP2 spells it: replicate over dim 0, shard over dim 1
            from torch.distributed.device_mesh import init_device_mesh
            world = int(os.environ["WORLD_SIZE"])
            mesh = init_device_mesh("neuron", (world // HSDP_SHARD, HSDP_SHARD),
                                    mesh_dim_names=("replicate", "shard"))
        for name in w.fsdp_units:
            fully_shard(model.get_submodule(name), mesh=mesh, **kw)
    elif layout == "fsdptp":
        # 2-D as TorchTitan lays it out: TP inside (mesh dim "tp"), FSDP2 across ("dp")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        world = int(os.environ["WORLD_SIZE"])
        # HSDP_REPLICATE=R > 1: 3-D, FSDP2 over a (replicate, shard) sub-mesh (HSDP x TP;
        # a shard dim of 1 is data parallelism x TP as FSDP2 spells it)
        r = int(os.environ.get("HSDP_REPLICATE", "1"))
        if r > 1:
            mesh = init_device_mesh("neuron", (r, world // (r * TP_2D), TP_2D),
                                    mesh_dim_names=("replicate", "shard", "tp"))
            dp = mesh["replicate", "shard"]
        else:
            mesh = init_device_mesh("neuron", (world // TP_2D, TP_2D), mesh_dim_names=("dp", "tp"))
            dp = mesh["dp"]
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, mesh["tp"], {k: styles[v]() for k, v in w.tp_plan.items()})
        for name in w.fsdp_units:
            fully_shard(model.get_submodule(name), mesh=dp)
    elif layout in ("tp", "sp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)
        mesh = init_device_mesh("neuron", (int(os.environ["WORLD_SIZE"]),))
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        if layout == "sp":
            # the sequence (dim 0 of tokens x features, dim 1 of batch x sequence x
            # features) sharded outside the colwise-rowwise pairs
            seq = _sequence_dim(w)
            styles = {"colwise": lambda: ColwiseParallel(input_layouts=Shard(seq)),
                      "rowwise": lambda: RowwiseParallel(output_layouts=Shard(seq)),
                      "sequence": lambda: SequenceParallel(sequence_dim=seq)}
        parallelize_module(model, mesh, {k: styles[v]() for k, v in w.tp_plan.items()})
    opt = (w.optimizer or (lambda m: torch.optim.SGD(m.parameters(), lr=0.01)))(model)
    return model, opt


def traced_step(model_name: str, layout: str, dev, rank: int = 0):
    """Builds, warms up (FSDP's lazy init, DTensor's sharding caches) and traces one step."""
    w = MODELS[model_name]
    model, opt = build(model_name, layout, dev)
    # TP ranks must see the same tokens; FSDP ranks (data parallel) see their own.
    seed = rank // TP_2D if layout == "fsdptp" else rank if "sdp" in layout else 0
    g = torch.Generator().manual_seed(seed)
    x = w.batch(g).to(dev)
    if layout == "sp":   # each rank feeds its share of the sequence
        x = x.chunk(int(os.environ["WORLD_SIZE"]), _sequence_dim(w))[rank].contiguous()

    def step():
        opt.zero_grad(set_to_none=True)
        w.loss(model, x).backward()
        opt.step()

    step()
    step()
    single = layout == "single"
    with plan.trace(dev, model if single else None, opt if single else None) as t:
        step()
    return t


def main():
    """``_replay_step.py MODES [WORLD]``: MODES a comma-separated list of ``<model>-<layout>``,
    run one after the other in one process group; a ``-single`` mode also prints its
    replays for WORLD ranks (default 2)."""
    modes = sys.argv[1].split(",")
    # The replay prices op by op; Adaptive Eager windows (fused pointwise kernels) close at
    # every collective and stream wait of the real runs, which the single-device step does
    # not have, so both sides run unfused (docs/plan.md, "Replaying a traced step");
    # REPLAY_ADAPTIVE_EAGER=1 keeps it on, to measure what that costs the replay.
    torch_neuronx.set_adaptive_eager(os.environ.get("REPLAY_ADAPTIVE_EAGER") == "1")
    rank = int(os.environ.get("RANK", "0"))
    distributed = not all(m.endswith("-single") for m in modes)
    if distributed:
        import torch.distributed as dist
        dist.init_process_group("neuron")
    dev = torch.device("neuron", rank)
    torch.neuron.set_device(dev)
    out = {}
    for mode in modes:
        model_name, layout = mode.split("-")
        t = traced_step(model_name, layout, dev, rank)
        out[mode] = {"seconds": t.seconds, "flops": t.flops, "collectives": t.collectives,
                     "memory_peak": t.memory_peak, "memory_start": t.memory_start,
                     "ops": [[o.charge.name, o.charge.count, o.charge.seconds,
                              [list(s) for s in o.charge.shapes or ()], o.module, o.backward,
                              o.charge.bytes_in, o.charge.bytes_out, o.charge.stream,
                              o.charge.epoch] for o in t.ops]}
        if layout == "single":
            world, w = int(sys.argv[2]) if len(sys.argv) > 2 else 2, MODELS[model_name]
            out[mode]["fsdp"] = t.replay_layout(fsdp=world, fsdp_units=w.fsdp_units).seconds
            if world > HSDP_SHARD and world % HSDP_SHARD == 0:
                out[mode]["hsdp"] = t.replay_layout(fsdp=HSDP_SHARD, fsdp_units=w.fsdp_units,
                                                    replicate=world // HSDP_SHARD).seconds
            if w.tp_plan:
                out[mode]["tp"] = t.replay_layout(tp=world, tp_plan=w.tp_plan).seconds
    print("TRACE " + json.dumps(out), flush=True)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
