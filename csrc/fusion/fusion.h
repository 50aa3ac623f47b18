// Adaptive Eager Execution: the per-device window of pointwise and row ops that runs as one
// chunked kernel. Built on the runtime (its queue runs the window's kernel); the launch path
// (aten/) appends to it.
#pragma once

#include "../runtime/runtime.h"

namespace neuron {

// Adaptive Eager Execution (fusion.cpp): pointwise ops, last-dim reductions and last-dim
// concatenations wait in a per-device window and run as one chunked kernel, bit-identical
// to eager.
namespace fusion {
struct Op {
  std::optional<c10::OperatorHandle> kernel;  // the out= overload, or the in-place op
  std::function<void()> run;          // the op alone, when the window holds only it
  std::vector<c10::IValue> args;      // device tensors stay device tensors here
  std::vector<at::Tensor> outs;       // the fresh output (out= ops)
  bool use_out = false;
  int self = -1;                      // the argument an in-place op writes
  // An in-place op that writes all of self without reading it (a cast's `copy_` into the
  // tensor `.to()` just made): self is then a fresh output, dead when only the window holds it.
  bool overwrites = false;
  int64_t numel = 0;
  std::vector<int64_t> shape;         // iteration shape: the output's, a reduction's input's
  // pure: every operand contiguous and of `shape` (chunks of the flat range are independent).
  // row: operands broadcast to `shape`, or it reduces or concatenates along the last dim
  // (blocks of whole rows are independent). exact: each element's value does not depend on
  // which of ATen's vector or scalar loops computes it; split_free: nor do its bits where NaNs
  // are involved (which NaN a result is).
  bool pure = false, row = false, exact = false, split_free = false;
  // A `_foreach_` op: one pure op per list index (then `shape` holds their element counts).
  std::vector<Op> parts;
  const char* name = nullptr;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<at::Tensor> shape_tensors;  // for the cost record
  int64_t bytes_in = 0, bytes_out = 0;
  // Launched while the thread's ops were recorded for the cost model (not inside a Python
  // kernel that charges its own time, nkilib_routes.charged_as).
  bool recorded = true;
};
struct Stats {
  int64_t ops, kernels, fused_kernels, fused_ops, one_pass_ops;
};
bool enabled();
void set_enabled(bool on);
void count_launch();  // a launch that bypasses the window: one op, one kernel
void append(c10::DeviceIndex d, int64_t stream, Op op);
void flush(c10::DeviceIndex d);
void flush_all();
bool holding(c10::DeviceIndex d);  // ops are waiting in the device's window
// Can fp32 exp run in one-pass runs (fused_exact.cpp), bit for bit as ATen's kernel computes it?
bool exp_joins_runs();
Stats stats(bool reset);
}  // namespace fusion

}  // namespace neuron
