// Stochastic rounding (NEURON_RT_STOCHASTIC_ROUNDING_EN): the switch and the hand-off to
// the Python rounding code (torch_neuronx/kernels/stochastic_rounding.py). The hooks run
// with the switch suspended on this thread, so the fp32 ops they issue take the ordinary
// path and their exact narrowing casts do not draw random numbers again.
#include "aten.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>

namespace neuron::sr {
namespace {

std::atomic<bool> g_on{false};
thread_local int t_suspended = 0;
OpHook g_op_hook = nullptr;
CopyHook g_copy_hook = nullptr;

struct Suspend {
  Suspend() { ++t_suspended; }
  ~Suspend() { --t_suspended; }
};

bool narrow(c10::ScalarType t) { return t == c10::kHalf || t == c10::kBFloat16; }

bool narrow_device_tensor(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const auto& t = v.toTensor();
  return t.defined() && t.device().type() == kDevice && narrow(t.scalar_type());
}

// (A dtype argument's type() is int; real_type() keeps ScalarType.)
bool is_dtype_arg(const c10::Argument& a) {
  auto ty = a.real_type();
  if (auto opt = ty->castRaw<c10::OptionalType>()) ty = opt->getElementType();
  return ty->kind() == c10::TypeKind::ScalarTypeType;
}

}  // namespace

bool active() { return g_on.load(std::memory_order_relaxed) && t_suspended == 0; }
bool enabled() { return g_on.load(); }
void set_enabled(bool on) { g_on.store(on); }
void set_hooks(OpHook op, CopyHook copy) {
  g_op_hook = op;
  g_copy_hook = copy;
}

bool wants(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const size_t base = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[base + i];
    if (narrow_device_tensor(v)) return true;
    if (v.isList()) {
      auto list = v.toList();
      for (size_t k = 0; k < list.size(); ++k) {
        if (narrow_device_tensor(list.get(k))) return true;
      }
    } else if (v.isInt() && is_dtype_arg(args[i]) &&
               narrow(static_cast<c10::ScalarType>(v.toInt()))) {
      return true;
    }
  }
  return false;
}

bool handle_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!g_op_hook) return false;
  Suspend s;
  return g_op_hook(op, stack);
}

bool narrowing_copy(const at::Tensor& src, const at::Tensor& dst) {
  return active() && g_copy_hook && dst.device().type() == kDevice &&
         narrow(dst.scalar_type()) && src.scalar_type() != dst.scalar_type() &&
         c10::isFloatingType(src.scalar_type()) && dst.layout() == c10::kStrided &&
         src.layout() == c10::kStrided;
}

void copy(const at::Tensor& src, const at::Tensor& dst) {
  Suspend s;
  g_copy_hook(src, dst);
}

}  // namespace neuron::sr
