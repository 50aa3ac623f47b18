"""NKI-lib: Trainium kernels written in ``nki``, under AWS's module paths and signatures.

``nkilib.core`` holds the kernels behind the model families (attention, norms, RoPE, MLP,
cumsum); each takes and returns HBM tensors (NumPy arrays, or torch tensors through the
``nki.frameworks`` bridge) and runs in the NKI simulator within the target's hardware rules.
docs/nkilib.md lists each kernel, its layouts and its modelled latency.
"""
