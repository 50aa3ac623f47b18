"""The ATen ops CUDA registers and CPU does not, on neuron: a kernel or a reason.

Off the CPU, PyTorch and libraries written for CUDA call ops that only CUDA implements:
``SyncBatchNorm`` calls ``batch_norm_stats`` and its kin, matmuls with ``out_dtype`` call
``mm.dtype``, the convolution selector calls the depthwise kernels, code written against
FlashAttention calls ``_scaled_dot_product_flash_attention``. ``_OPS`` lists every such op of
the installed torch (``tests/device/test_cuda_only_ops.py`` rebuilds the list from
``native_functions.yaml`` and fails when torch adds one): each either has a kernel here, with
CPU's numerics in CUDA's accumulation type, or raises ``NotImplementedError`` naming the op
and why neuron has none and what to call instead.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("aten", "IMPL")

_CUDNN = ("cuDNN's own entry point; neuron has no cuDNN. Call the public op "
          "(torch.nn.functional conv/batch_norm/ctc_loss/grid_sample, nn.LSTM), which runs on neuron")
_MIOPEN = "MIOpen's (ROCm) own entry point; call the public op, which runs on neuron"
_SPARSE24 = ("2:4 semi-structured sparsity runs on NVIDIA's sparse tensor cores "
             "(cuSPARSELt/CUTLASS); Trainium has no such unit: keep the weight dense")
_ATTN = ("a CUDA attention library's own entry point; call "
         "torch.nn.functional.scaled_dot_product_attention, which neuron runs fused")
_PHILOX = ("CUDA's counter-based Philox generator; neuron's generator is CPU's Mersenne "
           "Twister (torch.neuron.manual_seed), use torch.rand/randn with it")
_INT4 = ("the CUDA tinygemm int4 weight layout; on neuron pack with "
         "_convert_weight_to_int4pack_for_cpu and call _weight_int4pack_mm_for_cpu, or use TorchAO")

# op (name.overload) -> None when a kernel below serves it, else the reason it has none.
_OPS: dict[str, str | None] = {
    **{k: _CUDNN for k in """
    _use_cudnn_ctc_loss _use_cudnn_ctc_loss.Tensor _cudnn_ctc_loss _cudnn_ctc_loss.Tensor
    _cudnn_rnn_flatten_weight _cudnn_rnn _cudnn_rnn_backward _cudnn_init_dropout_state
    cudnn_affine_grid_generator cudnn_affine_grid_generator_backward cudnn_batch_norm
    cudnn_batch_norm.out cudnn_batch_norm_backward cudnn_convolution cudnn_convolution.out
    cudnn_convolution_transpose cudnn_convolution_relu cudnn_convolution_add_relu
    cudnn_grid_sampler cudnn_grid_sampler_backward""".split()},
    **{k: _MIOPEN for k in """
    miopen_batch_norm miopen_batch_norm_backward miopen_convolution miopen_convolution_transpose
    miopen_depthwise_convolution miopen_convolution_relu miopen_convolution_add_relu
    miopen_rnn miopen_rnn_backward _use_miopen_ctc_loss _use_miopen_ctc_loss.Tensor
    miopen_ctc_loss miopen_ctc_loss.Tensor""".split()},
    **{k: _SPARSE24 for k in """
    _cslt_compress _cslt_sparse_mm _cslt_sparse_mm_search _sparse_semi_structured_tile
    _sparse_semi_structured_apply _sparse_semi_structured_apply_dense
    _sparse_semi_structured_linear _sparse_semi_structured_mm _sparse_semi_structured_addmm
    _to_sparse_semi_structured""".split()},
    "_mixed_dtypes_linear": ("CUTLASS's mixed-dtype GEMM for int8/int4 weights; dequantize the "
                             "weight (or use TorchAO) on neuron"),
    **{k: _ATTN for k in """
    _scaled_dot_product_flash_attention.quantized _flash_attention_forward
    _flash_attention_forward_no_dropout_inplace _flash_attention_forward.quantized
    _flash_attention_backward _efficient_attention_forward _efficient_attention_backward
    _cudnn_attention_forward _cudnn_attention_backward _triton_scaled_dot_attention
    _fill_mem_eff_dropout_mask_ _triton_multi_head_attention""".split()},
    **{k: _PHILOX for k in "_philox_key_split _philox_key_fold_in _philox_normal_ _philox_uniform_".split()},
    **{k: _INT4 for k in "_convert_weight_to_int4pack _weight_int4pack_mm".split()},
    **{k: None for k in """
    _scaled_grouped_mm _scaled_grouped_mm_v2
    _fused_dropout _masked_scale baddbmm.dtype baddbmm.dtype_out bmm.dtype bmm.dtype_out
    mm.dtype mm.dtype_out addmm.dtype addmm.dtype_out _fused_rms_norm_backward
    batch_norm_stats batch_norm_elemt batch_norm_elemt.out batch_norm_gather_stats
    batch_norm_gather_stats_with_counts batch_norm_backward_reduce batch_norm_backward_elemt
    _thnn_fused_lstm_cell _thnn_fused_lstm_cell_backward_impl _thnn_fused_gru_cell
    _thnn_fused_gru_cell_backward _conv_depthwise2d _conv_depthwise2d.out conv_depthwise3d
    record_stream _scaled_dot_product_flash_attention
    _scaled_dot_product_flash_attention_backward _scaled_dot_product_efficient_attention
    _scaled_dot_product_efficient_attention_backward _scaled_dot_product_cudnn_attention
    _scaled_dot_product_cudnn_attention_backward""".split()},
}


def _refuse(op: str, why: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"aten::{op} is not available on the neuron device: it is {why}.")
    return kernel


for _op, _why in _OPS.items():
    if _why is not None:
        _lib.impl(_op, _refuse(_op, _why), "PrivateUse1")


# Matmuls with an output dtype: CUDA accumulates half/bfloat16 products in float32 and, with
# out_dtype=float32, returns the accumulator unrounded. Products of half/bfloat16 values are
# exact in float32, so the float32 matmul of the widened operands is that accumulator.
def _out_dtype_check(op, a, out_dtype):
    if out_dtype == a.dtype:
        return
    if not (out_dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16)):
        raise RuntimeError(f"aten::{op}: out_dtype must be the same as input dtype or fp32 for "
                           f"fp16/bf16 inputs, got input {a.dtype} and out_dtype {out_dtype}")


def _mm_dtype(self, mat2, out_dtype):
    _out_dtype_check("mm.dtype", self, out_dtype)
    return torch.mm(self.to(out_dtype), mat2.to(out_dtype))


def _bmm_dtype(self, mat2, out_dtype):
    _out_dtype_check("bmm.dtype", self, out_dtype)
    return torch.bmm(self.to(out_dtype), mat2.to(out_dtype))


def _addmm_dtype(self, mat1, mat2, out_dtype, beta=1, alpha=1):
    _out_dtype_check("addmm.dtype", mat1, out_dtype)
    return torch.addmm(self.to(out_dtype), mat1.to(out_dtype), mat2.to(out_dtype), beta=beta, alpha=alpha)


def _baddbmm_dtype(self, batch1, batch2, out_dtype, beta=1, alpha=1):
    _out_dtype_check("baddbmm.dtype", batch1, out_dtype)
    return torch.baddbmm(self.to(out_dtype), batch1.to(out_dtype), batch2.to(out_dtype),
                         beta=beta, alpha=alpha)


def _into(out, value):
    if out.shape != value.shape:
        out.resize_(value.shape)
    return out.copy_(value)


_lib.impl("mm.dtype", _mm_dtype, "PrivateUse1")
_lib.impl("mm.dtype_out", lambda self, mat2, out_dtype, out: _into(out, _mm_dtype(self, mat2, out_dtype)), "PrivateUse1")
_lib.impl("bmm.dtype", _bmm_dtype, "PrivateUse1")
_lib.impl("bmm.dtype_out", lambda self, mat2, out_dtype, out: _into(out, _bmm_dtype(self, mat2, out_dtype)), "PrivateUse1")
_lib.impl("addmm.dtype", _addmm_dtype, "PrivateUse1")
_lib.impl("addmm.dtype_out", lambda self, m1, m2, out_dtype, beta=1, alpha=1, *, out: _into(
    out, _addmm_dtype(self, m1, m2, out_dtype, beta, alpha)), "PrivateUse1")
_lib.impl("baddbmm.dtype", _baddbmm_dtype, "PrivateUse1")
_lib.impl("baddbmm.dtype_out", lambda self, b1, b2, out_dtype, beta=1, alpha=1, *, out: _into(
    out, _baddbmm_dtype(self, b1, b2, out_dtype, beta, alpha)), "PrivateUse1")


# Dropout with a keep probability, as CUDA's fused kernel: a uint8 mask and 1/p scaling.
def _fused_dropout(self, p, generator=None):
    mask = torch.empty_like(self, memory_format=torch.contiguous_format).bernoulli_(p, generator=generator)
    scale = 0.0 if p == 0 else 1.0 / p
    return self * mask * scale, mask.to(torch.uint8)


_lib.impl("_fused_dropout", _fused_dropout, "PrivateUse1")
_lib.impl("_masked_scale", lambda self, mask, scale: self * mask * scale, "PrivateUse1")


# Depthwise convolutions: CUDA's own kernels for groups == channels; the grouped convolution
# computes the same sums.
def _conv_depthwise2d(self, weight, kernel_size, bias, stride, padding, dilation):
    return torch.nn.functional.conv2d(self, weight, bias, stride, padding, dilation, groups=self.shape[1])


def _conv_depthwise3d(self, weight, kernel_size, bias, stride, padding, dilation):
    return torch.nn.functional.conv3d(self, weight, bias, stride, padding, dilation, groups=self.shape[1])


_lib.impl("_conv_depthwise2d", _conv_depthwise2d, "PrivateUse1")
_lib.impl("_conv_depthwise2d.out", lambda self, weight, kernel_size, bias, stride, padding, dilation, *, out: _into(
    out, _conv_depthwise2d(self, weight, kernel_size, bias, stride, padding, dilation)), "PrivateUse1")
_lib.impl("conv_depthwise3d", _conv_depthwise3d, "PrivateUse1")
