"""Mixture of experts: Transformers ``MixtralForCausalLM`` from a tiny config (its router
counts tokens per expert with an integer ``histc``, as on CUDA), and a grouped-GEMM MoE layer
that runs every expert in one ``torch._grouped_mm`` call over tokens sorted by expert.
Run: ``python examples/models/moe_mixtral.py``."""
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from ._harness import Family, causal_lm, main
except ImportError:
    from _harness import Family, causal_lm, main


def build():
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=64, router_aux_loss_coef=0.02,
                        output_router_logits=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    return MixtralForCausalLM(cfg)


class GroupedMoE(nn.Module):
    """Top-k routed SwiGLU experts, all experts in one grouped GEMM per projection.

    Tokens are sorted by expert; ``offs`` holds each expert's end row, as ``torch._grouped_mm``
    takes them (the layout CUDA's grouped GEMM and Trainium's blockwise MoE kernels use).
    bf16 weights with row counts padded to 16 bytes, as the grouped GEMM requires.
    """

    def __init__(self, dim=64, hidden=64, experts=4, top_k=2):
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_gate = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w_up = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w_down = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        tokens = x.repeat_interleave(self.top_k, dim=0)[order].bfloat16()
        counts = torch.bincount(flat, minlength=self.experts)
        offs = counts.cumsum(0).to(torch.int32)
        gate = torch._grouped_mm(tokens, self.w_gate.bfloat16(), offs=offs)
        up = torch._grouped_mm(tokens, self.w_up.bfloat16(), offs=offs)
        y = torch._grouped_mm(F.silu(gate) * up, self.w_down.bfloat16(), offs=offs)
        out = torch.empty_like(y).index_copy_(0, order, y).view(-1, self.top_k, shape[-1])
        return (out.float() * weights.unsqueeze(-1)).sum(1).view(shape).to(x.dtype)


class GroupedMoEModel(nn.Module):
    def __init__(self, vocab=128, dim=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.RMSNorm(dim)
        self.moe = GroupedMoE(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.moe(self.norm(h)))


def _gm_loss(model, b):
    logits = model(b[0][:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), b[0][:, 1:].flatten())


FAMILY = causal_lm("mixture of experts (Mixtral)", build, seed=7)
GROUPED = Family("mixture of experts (grouped GEMM)", GroupedMoEModel, FAMILY.batch, _gm_loss,
                 lambda model, b: model(b[0]).argmax(-1))

if __name__ == "__main__":
    main(FAMILY)
    main(GROUPED)
