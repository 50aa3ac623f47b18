// Can this launch join the device's Adaptive Eager window, and in which mode (pure chunks,
// whole rows, exact elementwise)? The window itself is in fusion/.
#include "launch_internal.h"

#include <ATen/Parallel.h>

#include <string>
#include <unordered_map>

namespace neuron::launch::detail {

namespace {
using c10::IValue;

// Every tensor operand a CPU scalar or a device tensor that `fits`; no lists, no generators.
template <class F>
bool operands_fit(const torch::jit::Stack& stack, size_t base, size_t n, F&& fits) {
  for (size_t i = 0; i < n; ++i) {
    const IValue& v = stack[base + i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) continue;
      if (t.device().is_cpu() ? t.dim() != 0 : !fits(t)) return false;
    } else if (v.isList() || v.isGenerator()) {
      return false;
    }
  }
  return true;
}

}  // namespace

at::Tensor snapshot_cpu_scalar(const at::Tensor& t) {
  auto c = t.clone();
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) c.unsafeGetTensorImpl()->set_wrapped_number(true);
  return c;
}

// The tensor a pointwise op writes: its fresh output, or self for an in-place op.
const at::Tensor& written(const Plan& plan, const torch::jit::Stack& stack, size_t base,
                          const std::vector<at::Tensor>& out_dev) {
  return plan.inplace_self >= 0 ? stack[base + plan.inplace_self].toTensor() : out_dev[0];
}

// Every tensor operand a contiguous device tensor of the output's shape (or a CPU scalar),
// and a fresh output the out= overload writes exactly: chunks of it are then independent.
bool fusible(const Plan& plan, const torch::jit::Stack& stack, size_t base, size_t n,
             const std::vector<at::Tensor>& out_dev, bool use_out) {
  if (plan.inplace_self < 0 && !use_out) return false;
  const at::Tensor& shaped = written(plan, stack, base, out_dev);
  // Below eager's parallel grain a tensor is cache-resident anyway: fusing saves nothing
  // there and would only add the window's bookkeeping to the launch.
  if (!shaped.defined() || !shaped.is_contiguous() || shaped.numel() < at::internal::GRAIN_SIZE) {
    return false;
  }
  return operands_fit(stack, base, n, [&](const at::Tensor& t) {
    return t.is_contiguous() && t.sizes() == shaped.sizes();
  });
}


// Ops whose result for an element does not depend on whether ATen's vectorized loop or its
// scalar tail computes it: IEEE-exact arithmetic (no fused multiply-add), comparisons and
// selections. Transcendental functions are not: their vector and scalar versions differ in
// the last bit, so where a fused kernel splits their range matters. fp32 exp is the exception
// where ATen computes it with MKL (one function for every element; see exp_joins_runs).
// `nan`: how its NaN results depend on the loop.
bool exact_op(const c10::FunctionSchema& s, const torch::jit::Stack& stack, size_t base, NanLoop& nan) {
  using N = NanLoop;
  static const std::unordered_map<std::string, std::pair<int, N>> names = {
      {"aten::add", {1, N::kFree}}, {"aten::sub", {1, N::kFree}}, {"aten::rsub", {1, N::kFree}},
      {"aten::mul", {0, N::kLoop}}, {"aten::neg", {0, N::kFree}}, {"aten::abs", {0, N::kFree}},
      {"aten::maximum", {0, N::kLoop}}, {"aten::minimum", {0, N::kLoop}},
      {"aten::clamp", {0, N::kLoopWithTensorBound}}, {"aten::clamp_min", {0, N::kLoopWithTensorBound}},
      {"aten::clamp_max", {0, N::kLoopWithTensorBound}}, {"aten::relu", {0, N::kFree}},
      {"aten::where", {0, N::kCopied}}, {"aten::sqrt", {0, N::kFree}}, {"aten::rsqrt", {4, N::kFree}},
      {"aten::reciprocal", {0, N::kFree}}, {"aten::eq", {0, N::kFree}}, {"aten::ne", {0, N::kFree}},
      {"aten::lt", {0, N::kFree}}, {"aten::le", {0, N::kFree}}, {"aten::gt", {0, N::kFree}},
      {"aten::ge", {0, N::kFree}}, {"aten::div", {2, N::kFree}}, {"aten::pow", {3, N::kFree}},
      {"aten::exp", {5, N::kFree}}};
  auto it = names.find(s.name());
  if (it == names.end()) return false;
  nan = it->second.second;
  const auto& args = s.arguments();
  auto arg = [&](const char* name) -> const IValue* {
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].name() == name) return &stack[base + i];
    }
    return nullptr;
  };
  switch (it->second.first) {
    case 1: {  // `self + alpha * other` runs as one fused multiply-add in the vector loop
      const IValue* alpha = arg("alpha");
      return !alpha || (alpha->isScalar() && alpha->toScalar().equal(1));
    }
    case 2:  // true division only
      return s.overload_name() == "Tensor" || s.overload_name() == "Scalar";
    case 3: {  // x ** 2 is x * x in both loops
      const IValue* e = arg("exponent");
      return s.overload_name() == "Tensor_Scalar" && e && e->isScalar() && e->toScalar().equal(2);
    }
    case 4: {  // in bf16/fp16 the scalar loop rounds sqrt(x) before dividing, the vector one not
      const IValue& self = stack[base];
      return self.isTensor() && (self.toTensor().scalar_type() == c10::kFloat ||
                                 self.toTensor().scalar_type() == c10::kDouble);
    }
    case 5: {
      const IValue& self = stack[base];
      return self.isTensor() && self.toTensor().scalar_type() == c10::kFloat && fusion::exp_joins_runs();
    }
    default:
      return true;
  }
}

// Does an exact op's result depend on the loop in no bit, NaNs included? (fusion::Op::split_free)
bool split_free(NanLoop nan, const c10::FunctionSchema& s, c10::ScalarType result) {
  if (!c10::isFloatingType(result) || nan == NanLoop::kCopied) return true;
  if (result != c10::kFloat && result != c10::kDouble) return false;
  return nan == NanLoop::kFree ||
         (nan == NanLoop::kLoopWithTensorBound && s.overload_name().find("Tensor") == std::string::npos);
}

// Does a row op qualify: its `dim` is the last one of a tensor of rank >= 2 (for cat, every
// input's), every operand is on this device, and `iter` gets its iteration shape.
// window_open: ops wait in the device's fusion window. A small op only ever joins one that is
// open (small tensors start none), so without one it is turned away before any scan.
bool row_fusible(const Plan& plan, const torch::jit::Stack& stack, size_t base, size_t n,
                 const std::vector<at::Tensor>& out_dev, bool use_out, bool window_open,
                 std::vector<int64_t>& iter) {
  auto is_dev = [](const at::Tensor& t) { return t.defined() && t.device().type() == kDevice; };
  auto worth = [&](const at::Tensor& t) { return window_open || t.numel() >= at::internal::GRAIN_SIZE; };
  auto last = [](const IValue& d, int64_t rank) {
    int64_t v;
    if (d.isInt()) v = d.toInt();
    else if (d.isIntList() && d.toIntList().size() == 1) v = d.toIntList()[0];
    else return false;
    return v == -1 || v == rank - 1;
  };
  if (plan.row_kind != Plan::kNone) {
    if (!use_out || out_dev.size() != 1 || !out_dev[0].defined()) return false;
    const IValue& in = stack[base];
    if (plan.row_kind == Plan::kReduction) {
      // Reduced rows contiguous: ATen then reduces each row by itself, the same way in a
      // block of rows as in the whole tensor (strided rows it may reduce several at once).
      if (!in.isTensor() || !is_dev(in.toTensor()) || in.toTensor().dim() < 2) return false;
      if (!worth(in.toTensor()) || in.toTensor().stride(-1) != 1) return false;
      if (!last(stack[base + plan.dim_arg], in.toTensor().dim())) return false;
      iter = in.toTensor().sizes().vec();
    } else {
      const at::Tensor& o = out_dev[0];
      if (!in.isTensorList() || o.dim() < 2 || !worth(o) || !last(stack[base + plan.dim_arg], o.dim())) {
        return false;
      }
      for (const at::Tensor& t : in.toTensorList()) {
        if (!is_dev(t) || t.dim() != o.dim() || t.scalar_type() != o.scalar_type() ||
            t.sizes().slice(0, o.dim() - 1) != o.sizes().slice(0, o.dim() - 1)) {
          return false;
        }
      }
      iter = o.sizes().vec();
    }
    for (size_t i = 1; i < n; ++i) {
      if (stack[base + i].isTensor() || stack[base + i].isList()) {
        if (!stack[base + i].isIntList()) return false;
      }
    }
    return true;
  }
  if (plan.inplace_self < 0 && !use_out) return false;
  const at::Tensor& shaped = written(plan, stack, base, out_dev);
  if (!is_dev(shaped) || shaped.dim() < 2 || !worth(shaped)) return false;
  if (plan.inplace_self < 0 && !shaped.is_contiguous()) return false;
  auto O = shaped.sizes();
  // Operands broadcast to the iteration shape (right-aligned, each size equal or 1).
  bool ok = operands_fit(stack, base, n, [&](const at::Tensor& t) {
    if (t.dim() > int64_t(O.size())) return false;
    for (int64_t j = 0; j < t.dim(); ++j) {
      int64_t s = t.size(j), o = O[O.size() - t.dim() + j];
      if (s != o && s != 1) return false;
    }
    return true;
  });
  if (ok) iter = O.vec();
  return ok;
}

// The per-index ops of a `_foreach_` op, when every one can join a pure window: each index's
// tensors contiguous device tensors of one shape (shapes may differ between indices).
std::vector<fusion::Op> foreach_parts(const Plan& plan, const torch::jit::Stack& stack, size_t base,
                                      size_t n, const std::vector<at::Tensor>& out_dev) {
  if (!stack[base].isTensorList()) return {};
  const size_t len = stack[base].toListRef().size();
  const bool functional = plan.fresh.size() == 1;
  if (functional && out_dev.size() != len) return {};
  std::vector<fusion::Op> parts(len);
  int64_t total = 0;
  for (size_t i = 0; i < len; ++i) {
    fusion::Op& f = parts[i];
    for (size_t j = 0; j < n; ++j) {
      const IValue& v = stack[base + j];
      if (v.isList()) {
        if (v.toListRef().size() != len) return {};
        f.args.push_back(v.toListRef()[i]);
      } else {
        f.args.push_back(v);
      }
      if (f.args.back().isTensor() && f.args.back().toTensor().defined() &&
          f.args.back().toTensor().device().is_cpu()) {
        f.args.back() = snapshot_cpu_scalar(f.args.back().toTensor());
      }
    }
    const auto& pa = plan.part->schema().arguments();
    for (size_t j = n; j < pa.size() - (functional ? 1 : 0); ++j) f.args.push_back(*pa[j].default_value());
    const at::Tensor& shaped = functional ? out_dev[i] : f.args[0].toTensor();
    if (!shaped.defined() || shaped.device().type() != kDevice || !shaped.is_contiguous()) return {};
    if (!operands_fit(f.args, 0, n, [&](const at::Tensor& t) {
          return t.is_contiguous() && t.sizes() == shaped.sizes() && t.device() == shaped.device();
        })) {
      return {};
    }
    f.kernel = plan.part;
    f.use_out = functional;
    f.self = functional ? -1 : 0;
    if (functional) f.outs = {out_dev[i]};
    f.numel = shaped.numel();
    f.shape = shaped.sizes().vec();
    f.name = plan.part->schema().operator_name().name.c_str();
    f.dtype = shaped.scalar_type();
    f.pure = true;
    total += f.numel;
  }
  if (total < at::internal::GRAIN_SIZE) return {};
  return parts;
}

}  // namespace neuron::launch::detail
