import os

# Tests see one small modelled chip unless they ask for more; fast and deterministic.
os.environ.setdefault("TORCH_NEURONX_HBM_BYTES", "4GiB")
