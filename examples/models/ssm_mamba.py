"""State-space: Transformers ``MambaForCausalLM``. Its selective scan has no fused kernel off
CUDA, so the model takes its sequential slow path (a Python loop of small elementwise ops),
which Adaptive Eager and the compiler fuse on neuron. Run: ``python examples/models/ssm_mamba.py``."""

try:
    from ._harness import causal_lm, main
except ImportError:
    from _harness import causal_lm, main


def build():
    from transformers import MambaConfig, MambaForCausalLM
    cfg = MambaConfig(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2,
                      expand=2, conv_kernel=4, time_step_rank=4, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, use_mambapy=False)
    return MambaForCausalLM(cfg)


FAMILY = causal_lm("state-space (Mamba)", build, seed=2)

if __name__ == "__main__":
    main(FAMILY)
