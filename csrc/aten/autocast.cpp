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

// CUDA's "promote" ops (dot, addcmul, index_put, ...) run in the widest floating type among
// their neuron arguments. CUDA seeds that search with the autocast dtype, so half inputs
// under a bfloat16 autocast (neuron's default) fail with "Unexpected floating ScalarType in
// at::autocast::prioritize". Here the seed is the arguments alone: one low-precision dtype
// stays, any float32 or a float16/bfloat16 mix gives float32, doubles are left as they are.
// Wherever CUDA's rule answers, this answers the same.
bool eligible(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const auto& t = v.toTensor();
  return t.defined() && t.is_privateuseone() && t.is_floating_point() &&
         t.scalar_type() != c10::kDouble;
}

void promote_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastPrivateUse1);
  const size_t n = op.schema().arguments().size();
  const size_t base = stack->size() - n;
  c10::ScalarType to = c10::ScalarType::Undefined;
  auto meet = [&](c10::ScalarType t) {
    if (to == c10::ScalarType::Undefined || to == t) to = t;
    else to = c10::kFloat;
  };
  for (size_t i = base; i < stack->size(); ++i) {
    const auto& v = (*stack)[i];
    if (eligible(v)) meet(v.toTensor().scalar_type());
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        if (eligible(c10::IValue(t))) meet(t.scalar_type());
      }
    }
  }
  if (to != c10::ScalarType::Undefined) {
    for (size_t i = base; i < stack->size(); ++i) {
      auto& v = (*stack)[i];
      if (eligible(v) && v.toTensor().scalar_type() != to) v = v.toTensor().to(to);
      else if (v.isTensorList()) {
        auto list = v.toTensorList().copy();
        for (size_t k = 0; k < list.size(); ++k) {
          at::Tensor t = list.get(k);
          if (eligible(c10::IValue(t)) && t.scalar_type() != to) list.set(k, t.to(to));
        }
        v = std::move(list);
      }
    }
  }
  op.callBoxed(stack);
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define _NEURON_PROMOTE_BOXED(OP) \
  m.impl(#OP, torch::CppFunction::makeFromBoxedFunction<&promote_boxed>());
  AT_FORALL_PROMOTE(_NEURON_PROMOTE_BOXED)
#undef _NEURON_PROMOTE_BOXED
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define _NEURON_LOW(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define _NEURON_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define _NEURON_FP32_OPT(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_LOWER_PRECISION_FP(_NEURON_LOW)
  AT_FORALL_FP32(_NEURON_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(_NEURON_FP32_OPT)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#undef _NEURON_LOW
#undef _NEURON_FP32
#undef _NEURON_FP32_OPT
}

// CUDA bans binary_cross_entropy under autocast (a float16 probability saturates near 0 and 1);
// its with-logits form is autocast-safe. Without the ban the op failed on a dtype mismatch.
Tensor binary_cross_entropy_banned(const Tensor&, const Tensor&, const optional<Tensor>&,
                                   int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
              "autocast (on neuron as on CUDA): a sigmoid followed by binary cross entropy is "
              "computed safely by torch.nn.functional.binary_cross_entropy_with_logits or "
              "torch.nn.BCEWithLogitsLoss, which autocast to float32.");
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  m.impl("binary_cross_entropy", TORCH_FN(binary_cross_entropy_banned));
}
}  // namespace autocast_policy

}  // namespace neuron
