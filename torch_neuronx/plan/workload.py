"""A decoder-only transformer step as the planner sees it: its matmuls, element-wise passes
and parameters, per layer, derived from the architecture (no per-model constants).

Counting rules (each documented where used): a matmul of (m x k) by (k x n) is 2mkn FLOPs;
its backward is two matmuls of the same size (grad input, grad weight), so a training step
is 3x the forward's matmul FLOPs. Attention scores and their use are batched matmuls over
heads, counted in full as the device's cost model counts the kernels it runs. An element-wise
op reads its inputs and writes its output once.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Matmul:
    """One matmul per layer: ``count`` x (m, k, n); ``split`` the dim tensor parallelism
    divides: "n" (column-parallel), "k" (row-parallel) or "batch" (heads)."""
    name: str
    count: int
    m: int
    k: int
    n: int
    split: str


@dataclass(frozen=True)
class TransformerConfig:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int | None = None   # grouped-query attention; None: as many as heads
    ffn: int | None = None        # MLP width; None: 4 x hidden
    gated_mlp: bool = False       # SwiGLU (Llama): three MLP matrices instead of two
    experts: int = 1              # mixture-of-experts: experts per layer
    top_k: int = 1                # experts each token visits
    tied_embeddings: bool = False
    name: str = "transformer"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return (self.kv_heads or self.heads) * self.head_dim

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    def layer_params(self) -> int:
        h = self.hidden
        attn = h * (h + 2 * self.kv_dim) + h * h
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn_dim * self.experts
        router = h * self.experts if self.experts > 1 else 0
        return attn + mlp + router + 2 * h  # two norms' weights

    def layer_params_dense(self) -> int:
        """A layer's parameters with one expert (what expert parallelism does not shard)."""
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn_dim
        return self.layer_params() - mlp * (self.experts - 1)

    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params() + embed + self.hidden

    def active_params(self) -> int:
        """Parameters a token's forward touches (top_k of the experts)."""
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn_dim
        return self.params() - self.layers * mlp * (self.experts - self.top_k)

    def layer_matmuls(self, sequences: int) -> list:
        """The forward matmuls of one layer over ``sequences`` sequences of ``seq`` tokens."""
        t, h, s, d = sequences * self.seq, self.hidden, self.seq, self.head_dim
        mlp_n = 2 if self.gated_mlp else 1
        tokens_per_expert = t * self.top_k // self.experts if self.experts > 1 else t
        mm = [Matmul("qkv", 1, t, h, h + 2 * self.kv_dim, "n"),
              Matmul("scores", sequences * self.heads, s, d, s, "batch"),
              Matmul("attend", sequences * self.heads, s, s, d, "batch"),
              Matmul("attn_out", 1, t, h, h, "k"),
              Matmul("mlp_in", self.experts, tokens_per_expert, h, mlp_n * self.ffn_dim, "n"),
              Matmul("mlp_out", self.experts, tokens_per_expert, self.ffn_dim, h, "k")]
        if self.experts > 1:
            mm.append(Matmul("router", 1, t, h, self.experts, "none"))
        return mm

    def head_matmul(self, sequences: int) -> Matmul:
        return Matmul("lm_head", 1, sequences * self.seq, self.hidden, self.vocab, "n")

    def layer_elementwise_elems(self, sequences: int) -> int:
        """Elements one layer's element-wise ops read and write, forward: two norms (read,
        write), two residual adds (read two, write one), the MLP activation (read one or two,
        write one, over the expert tokens), softmax over the scores (read, write)."""
        t, h = sequences * self.seq, self.hidden
        act_tokens = t * self.top_k
        act = act_tokens * self.ffn_dim * (3 if self.gated_mlp else 2)
        softmax = 2 * sequences * self.heads * self.seq * self.seq
        return 2 * 2 * t * h + 2 * 3 * t * h + act + softmax

    def forward_flops(self, sequences: int) -> float:
        mms = self.layer_matmuls(sequences)
        per_layer = sum(2.0 * m.count * m.m * m.k * m.n for m in mms)
        head = self.head_matmul(sequences)
        return self.layers * per_layer + 2.0 * head.m * head.k * head.n

    def train_flops(self, sequences: int) -> float:
        return 3.0 * self.forward_flops(sequences)


PRESETS = {
    # The demo's GPT (torch_neuronx/demo/gpt.py defaults).
    "gpt-demo": TransformerConfig(layers=4, hidden=128, heads=4, vocab=256, seq=64, name="gpt-demo"),
    # Llama 3.2 1B and Llama 3 8B / 70B shapes (Meta's published configs).
    "llama-1b": TransformerConfig(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                                  seq=4096, gated_mlp=True, tied_embeddings=True, name="llama-1b"),
    "llama-8b": TransformerConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                                  seq=8192, gated_mlp=True, name="llama-8b"),
    "llama-70b": TransformerConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                                   seq=8192, gated_mlp=True, name="llama-70b"),
}
