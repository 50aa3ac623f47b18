// What the fusion window (fusion.cpp) and the rows kernel (fused_rows.cpp) share.
#pragma once

#include "neuron.h"

#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace neuron::fusion::detail {

using c10::IValue;

// Elements per chunk: a multiple of every vectorized loop's stride (2 vectors of up to 64
// bytes, for 1-byte dtypes 128 elements); large enough that ATen's per-call cost (a few
// microseconds) stays small next to the chunk's work, small enough (1 MiB of fp32) that a
// chain's chunks stay in cache. Per-thread scratch buffers hold one chunk of 8-byte values.
constexpr int64_t kChunk = 262144;

// One tensor operand as its op saw it at launch (the host may change a tensor's metadata
// before the window closes).
struct Ref {
  const void* buf;
  c10::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
  int64_t offset;
  int shift;  // the window's dim of this operand's dim 0 (operands broadcast right-aligned)
  bool write;
  int index = -1;  // a foreach op's list index (its chains run index by index)
};

// The window's own references to each TensorImpl: (one of its tensors, count).
using Refs = std::unordered_map<const c10::TensorImpl*, std::pair<const at::Tensor*, int64_t>>;

void count_refs(const std::vector<Op>& ops, Refs& refs);
// Is every reference to this fresh output (and to its storage) the window's own?
bool only_window_holds(const at::Tensor& t, const Refs& refs);
// Same elements in the same places (size-1 dims aside): blocking cuts both alike.
bool same_place(const Ref& a, const Ref& b);
// Eager's split of [0, n) across threads (at::parallel_for with TensorIterator's grain).
std::vector<std::pair<int64_t, int64_t>> eager_ranges(int64_t n);
// Per-thread buffer `slot` of kChunk * 8 bytes, kept across kernels.
c10::Storage scratch_buffer(size_t slot);
void launch_unfused(c10::DeviceIndex d, int64_t stream, std::vector<Op>& ops);
// What fusion saves is memory traffic: for intermediates the program has dropped (they never
// reach memory), and for values several ops touch (in cache between them, as an optimizer's
// in-place updates). A chain with neither would only pay the blocking's per-call cost.
// `touched[s]`: the values step s reads or writes.
bool saves_traffic(const std::vector<std::set<int>>& touched, const std::vector<bool>& dead);
void count_fused(int64_t n_ops);

// fused_rows.cpp: runs a rows window as one row-blocked kernel, or unfused when that could
// not be bit-identical to eager or would save nothing.
void flush_rows(c10::DeviceIndex d, int64_t stream, std::vector<Op>& ops,
                const std::vector<std::vector<Ref>>& refs, const std::vector<int64_t>& shape);

}  // namespace neuron::fusion::detail
