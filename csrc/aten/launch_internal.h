// What the asynchronous launch path knows of an op before it runs: its plan (fresh outputs,
// the out= overload, whether the fusion window may take it), made once per schema, and the
// per-launch tests of whether an op can join the Adaptive Eager window.
#pragma once

#include "aten.h"
#include "../runtime/runtime.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

namespace neuron::launch::detail {

struct Plan {
  bool eligible = false;
  bool has_tensor_input = false;  // a tensor argument the op reads (not only writes)
  std::vector<int> fresh;         // returns the op allocates
  std::vector<int> ret_arg;       // per return: the argument it writes, or -1
  std::optional<c10::OperatorHandle> out_op;  // out= overload writing the fresh returns
  bool pointwise = false;   // a candidate for the fusion window
  int inplace_self = -1;    // for an in-place op: the argument it writes and returns
  // Row ops the fusion window also takes: a reduction (over its `dim` argument) or a
  // concatenation (along its `dim` argument), when that dim turns out to be the last one.
  enum { kNone, kReduction, kCat, kForeach } row_kind = kNone;
  int dim_arg = -1;
  std::optional<c10::OperatorHandle> part;  // kForeach: the op applied to each list index
  int dropout_arg = -1;  // a seeded op that is deterministic when this argument is 0
  bool cost_flags = false;  // records flags beyond its shapes for the cost model (attention)
  // aten::index: its result's shape depends on the data only through boolean (or uint8) masks;
  // with integer indices it is the indices' broadcast shape, so it launches like any op.
  int int_indices_arg = -1;
  // Another library's op routed to the queue (route_to_queue): it returns nothing and only
  // writes into its arguments, so it launches without learning its outputs from a Meta
  // kernel (it has none; its catch-all composite would run on Meta tensors).
  bool no_meta = false;
};

// The op's plan, made on first use and never freed.
const Plan& plan_for(const c10::OperatorHandle& op);

// How an exact op's NaN results depend on ATen's loop where they are fp32/fp64 (which NaN a
// result is, not whether it is one): not at all; yes (mul of two NaNs gives one operand's NaN
// or the other's, maximum/minimum give an all-ones NaN in the vector loop and the default NaN
// in the scalar one); yes with tensor bounds only (clamp); or the op copies its operand's
// bits (where). bf16/fp16 kernels round a NaN to a different NaN in each loop, whatever the
// op. (Checked against ATen by tests/device/test_adaptive_eager_nan_order.py.)
enum class NanLoop : uint8_t { kFree, kLoop, kLoopWithTensorBound, kCopied };

// A CPU scalar operand as it is now (a queued kernel must not see later writes to it).
at::Tensor snapshot_cpu_scalar(const at::Tensor& t);
// The tensor a pointwise op writes: its fresh output, or self for an in-place op.
const at::Tensor& written(const Plan& plan, const torch::jit::Stack& stack, size_t base,
                          const std::vector<at::Tensor>& out_dev);
// Every operand contiguous and of the output's shape (chunks of it are then independent).
bool fusible(const Plan& plan, const torch::jit::Stack& stack, size_t base, size_t n,
             const std::vector<at::Tensor>& out_dev, bool use_out);
// Is each element's value independent of which of ATen's loops computes it?
bool exact_op(const c10::FunctionSchema& s, const torch::jit::Stack& stack, size_t base, NanLoop& nan);
bool split_free(NanLoop nan, const c10::FunctionSchema& s, c10::ScalarType result);
bool row_fusible(const Plan& plan, const torch::jit::Stack& stack, size_t base, size_t n,
                 const std::vector<at::Tensor>& out_dev, bool use_out, bool window_open,
                 std::vector<int64_t>& iter);
std::vector<fusion::Op> foreach_parts(const Plan& plan, const torch::jit::Stack& stack, size_t base,
                                      size_t n, const std::vector<at::Tensor>& out_dev);

}  // namespace neuron::launch::detail
