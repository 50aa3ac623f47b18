// What the fusion window (fusion.cpp) and the rows kernel (fused_rows.cpp) share.
#pragma once

#include <atomic>
#include "fusion.h"

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
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
extern std::atomic<int64_t> g_kernels;  // kernels launched (fusion.cpp's counters)
// What fusion saves is memory traffic: for intermediates the program has dropped (they never
// reach memory), and for values several ops touch (in cache between them, as an optimizer's
// in-place updates). A chain with neither would only pay the blocking's per-call cost.
// `touched[s]`: the values step s reads or writes.
bool saves_traffic(const std::vector<std::set<int>>& touched, const std::vector<bool>& dead);

// fused_rows.cpp: runs a rows window as one row-blocked kernel, or unfused when that could
// not be bit-identical to eager or would save nothing.
void flush_rows(c10::DeviceIndex d, int64_t stream, std::vector<Op>& ops,
                const std::vector<std::vector<Ref>>& refs, const std::vector<int64_t>& shape);

// Where eager's fp32 mul kernel met each element of its output. A product of two NaNs is one
// of them, and which one depends on the loop that computed it: ATen's vector loop and scalar
// tail give the second operand's, its compiler-vectorized tail in places the first's.
class EagerNanOrder {
 public:
  struct Operand {
    std::vector<int64_t> sizes, strides;  // as eager saw it; a scalar is 0-dim
  };
  // Built where the window is planned: eager's thread ranges are read there, outside any
  // parallel region (as eager's launch was).
  EagerNanOrder(Operand out, Operand a, Operand b);
  // Did eager give the element at `offset` (elements from the output's first) the first
  // operand's NaN?
  bool first(int64_t offset) const;
  // The output offset of an element from its coordinates in the run's shape (rows, then the
  // column; narrow instructions have column 0).
  int64_t offset(const int64_t* coords, int ncoords) const;

 private:
  void build() const;
  Operand out_, a_, b_;
  mutable std::once_flag once_;
  // The TensorIterator eager built: its shape and byte strides per operand (out, a, b).
  mutable std::vector<int64_t> shape_;
  mutable std::vector<int64_t> strides_[3];
  mutable std::vector<int> by_out_stride_;  // dims, largest output stride first
  mutable int kind_ = 0;
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // eager's thread ranges
};
// Does this machine's ATen fp32 mul follow a pattern EagerNanOrder can model? Probed once.
bool mul_nan_order_known();

// fused_exact.cpp: a run of consecutive IEEE-exact fp32 pointwise steps of one iteration
// shape, evaluated in one pass over L1-sized tiles. Operands are the plan's views (or
// values: whatever the plan numbers its memory operands by). A rows plan's run may instead
// go row by row (by_row): then its registers hold whole rows, steps may also compute per-row
// values (narrow: one element per row), and last-dim sum, mean and amax join it.
struct ExactRun {
  static constexpr int kMaxRegs = 16;
  enum Code : uint8_t { kAdd, kSub, kMul, kDiv, kNeg, kAbs, kSquare, kReciprocal, kExp,
                        kRowSum, kRowMean, kRowMax };
  struct Src {
    enum Kind : uint8_t { kReg, kMem, kScalar } kind = kScalar;
    int index = 0;  // register, or memory operand
    float scalar = 0;
  };
  struct Ins {
    Code code;
    Src a, b;
    int reg;
    int store = -1;  // memory operand the result is written to, if anyone reads it later
    bool narrow = false;  // by_row runs: a per-row value (reductions produce these)
    std::shared_ptr<const EagerNanOrder> nan_order;  // mul: both operands may be NaN
  };
  std::vector<Ins> ins;
  std::vector<int> mem;  // the plan's view of each memory operand
  int regs = 0;
  int first = 0, count = 0;  // the plan steps the run replaces
  bool by_row = false;
};
// One step decoded: operands are views (>= 0) or scalars.
struct ExactOp {
  ExactRun::Code code;
  int a = -1, b = -1;
  float sa = 0, sb = 0;
  int out = -1;
  bool narrow = false;
  std::shared_ptr<const EagerNanOrder> nan_order;
};
// The shape class of steps that go by row (whatever their shapes).
constexpr int kByRowClass = -1;
struct ExactStepInfo {
  std::optional<ExactOp> op;  // none: the step runs as its ATen kernel
  int shape_class = 0;        // a run's steps share their iteration shape, or kByRowClass
};
// Is the order in which reductions (row_reduction below) sum a row of `width` fp32 values
// ATen's own? Checked against ATen's sum kernel once per width.
bool row_sum_matches_aten(int64_t width);
// An op exact_op accepted, as a run instruction (nullopt if the evaluator lacks it or an
// operand is not fp32). `view[i]`: schema argument i's view, or -1 with `constant[i]` its
// value (null if none).
std::optional<ExactOp> decode_exact(const c10::FunctionSchema& s, const std::vector<int>& view,
                                    const std::vector<const IValue*>& constant, int out,
                                    const std::function<bool(int)>& is_float);
// A decoded product whose operands may both be NaN gets eager's loops over its operands
// (`operand(view)`: the view's sizes and strides as eager saw them) to give each such
// element the NaN eager gave it.
void model_nan_order(ExactOp& op, const std::function<EagerNanOrder::Operand(int)>& operand);
// Runs over maximal stretches of decoded steps. value_of: each view's value; touched: the
// values each step reads or writes; dead: values nobody outside the kernel reads.
std::vector<ExactRun> make_runs(const std::vector<ExactStepInfo>& steps, const std::vector<int>& value_of,
                                const std::vector<std::set<int>>& touched, const std::vector<bool>& dead);
// Where a memory operand lies: its element (row 0, column 0), the stride of each row dim
// (0 where it broadcasts) and of the column.
constexpr int kMaxRowDims = 8;
struct ExactPlace {
  float* ptr;
  int64_t col;
  int64_t row[kMaxRowDims];
};
// A fused kernel of n_ops ops, one_pass_ops of them in one-pass runs.
void count_fused(int64_t n_ops, int64_t one_pass_ops);
int64_t one_pass_ops(const std::vector<ExactRun>& runs);
// Where the evaluated elements lie in the run's full shape: the first row's index per row
// dim and the first column's (rows windows' blocks), or the flat offset (pure windows' chunks).
struct ExactOrigin {
  int64_t row[kMaxRowDims] = {};
  int64_t col = 0;
};
// Evaluates the run over rows x width elements (rows: the sizes of up to kMaxRowDims dims),
// tile by tile, or row by row for by_row runs.
void run_exact(const ExactRun& r, const ExactPlace* places, const int64_t* rows, int nrows, int64_t width,
               const ExactOrigin& origin);

}  // namespace neuron::fusion::detail
