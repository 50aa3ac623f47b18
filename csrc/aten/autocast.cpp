// Autocast on neuron: CUDA's op policy (the same op lists and casts), on the neuron key.
#include "aten.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace neuron {

// Autocast: CUDA's op policy, on the neuron dispatch key.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

namespace autocast_policy {
using namespace at::autocast;
using at::Tensor;
using c10::IntArrayRef;
using c10::Scalar;
using c10::ScalarType;
using c10::SymInt;
using c10::SymIntArrayRef;
using std::optional;

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define _NEURON_LOW(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define _NEURON_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define _NEURON_FP32_OPT(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define _NEURON_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(_NEURON_LOW)
  AT_FORALL_FP32(_NEURON_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(_NEURON_FP32_OPT)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(_NEURON_PROMOTE)
#undef _NEURON_LOW
#undef _NEURON_FP32
#undef _NEURON_FP32_OPT
#undef _NEURON_PROMOTE
}
}  // namespace autocast_policy

}  // namespace neuron
