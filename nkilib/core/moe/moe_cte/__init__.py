"""MoE for context encoding (prefill): blockwise expert MLPs, and the grouped matmul
``torch._grouped_mm`` on neuron is modelled by."""
