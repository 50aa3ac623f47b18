"""Kernels the device registers from Python, where CPU's kernels do not serve as CUDA's do.

Off the CPU, PyTorch takes CUDA's paths: fused RNN cells, SyncBatchNorm's pieces, fused
attention entries, dropout on the device generator, ops with CUDA-only dtypes. Each module
holds one such path; ``cuda_only`` lists every CUDA-only ATen op and what neuron does with it.
"""
from . import (attention, cuda_only, dropout, dtypes, grouped_mm, moe, nkilib_routes,  # noqa: F401
               norms, quantized, rms_norm, rnn, scaled_mm, stochastic_rounding, sync_batchnorm)
