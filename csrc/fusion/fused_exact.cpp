// Runs of IEEE-exact fp32 pointwise steps inside a fused kernel, evaluated in one pass over
// L1-sized tiles instead of one ATen call (and one pass through memory) per step. Each
// element's result is what ATen computes: the same single IEEE operation per step, no
// fused multiply-add (the extension builds with -ffp-contract=off, so no clone contracts), and
// scalars converted to float as ATen's TensorIterator converts them. Intermediates nobody
// reads after the run stay in the tiles.
#include "fusion_internal.h"

#include <ATen/Context.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/ops/amax_cpu_dispatch.h>
#include <ATen/ops/exp_cpu_dispatch.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mean_cpu_dispatch.h>
#include <ATen/ops/sum_cpu_dispatch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>

// MKL's vector exp, as libtorch_cpu exports it (Fortran interface: arguments by address; n is
// MKL_INT, 4 or 8 bytes, which an 8-byte little-endian integer below 2^31 serves as either).
// Weak: a torch built without MKL leaves it null.
extern "C" void VMSEXP_(const int64_t* n, const float* a, float* r, const int64_t* mode)
    __attribute__((weak));

namespace neuron::fusion::detail {

namespace {

// 4 KiB of fp32 per register: MKL's exp costs 13% more per element in calls of 256 than of
// 1024, and a run's few live registers still fit L1.
constexpr int kTile = 1024;
// By-row runs take short rows in groups of about 512 elements (2 KiB per register; measured
// against 256-4096 on softmax rows of 16-1024: larger groups spill the registers out of L1),
// at most 64 rows.
constexpr int64_t kGroupElems = 512, kMaxGroup = 64;
// The mode ATen's vml::vexp passes: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
constexpr int64_t kVmlMode = 0x2 | 0x140000 | 0x100;

void vml_exp(const float* a, float* r, int n) {
  const int64_t len = n;
  VMSEXP_(&len, a, r, &kVmlMode);
}

// A non-tensor operand as the float ATen's fp32 kernel sees.
bool scalar_of(const IValue* v, float& out) {
  if (!v) return false;
  if (v->isTensor()) {
    const at::Tensor& t = v->toTensor();
    if (!t.defined() || t.dim() != 0 || !t.device().is_cpu()) return false;
    if (c10::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
      out = static_cast<float>(t.item<int64_t>());
      return true;
    }
    if (!c10::isFloatingType(t.scalar_type())) return false;
    out = static_cast<float>(t.item<double>());
    return true;
  }
  if (!v->isScalar()) return false;
  const c10::Scalar s = v->toScalar();
  if (s.isIntegral(/*includeBool=*/false)) {
    out = static_cast<float>(s.toLong());
    return true;
  }
  if (!s.isFloatingPoint()) return false;
  out = static_cast<float>(s.toDouble());
  return true;
}

}  // namespace

}  // namespace neuron::fusion::detail

namespace neuron::fusion {

bool exp_joins_runs() {
  // ATen's fp32 exp kernel calls MKL's vector exp on whatever stretch it has (whole rows or
  // 8 KiB buffers), and that function's result for an element does not depend on where in
  // the stretch it lies (checked over all 2^32 inputs with stretches of 1-300 elements). A
  // run can then call it per tile. Checked here against ATen's own kernel, once, so a torch
  // whose exp is computed another way keeps exp out of runs.
  static const bool ok = [] {
    if (!VMSEXP_ || !at::hasMKL()) return false;
    std::vector<uint32_t> bits = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7fa00000u,
                                  0u, 0x80000000u, 1u, 0x807fffffu, 0x42b17218u, 0xc2cff1b5u};
    for (uint32_t k = 0; k < 40000; ++k) bits.push_back(k * 107377u + 12345u);
    at::Tensor x = at::empty({int64_t(bits.size())}, at::kFloat);
    std::memcpy(x.data_ptr(), bits.data(), bits.size() * 4);
    at::Tensor ref = at::empty_like(x);
    at::cpu::exp_out(ref, x);
    std::vector<float> got(bits.size());
    const float* in = x.const_data_ptr<float>();
    for (size_t i = 0, n = 1; i < got.size(); i += n, n = n % 293 + 1) {
      detail::vml_exp(in + i, got.data() + i, int(std::min(n, got.size() - i)));
    }
    return std::memcmp(got.data(), ref.const_data_ptr<float>(), got.size() * 4) == 0;
  }();
  return ok;
}

}  // namespace neuron::fusion

namespace neuron::fusion::detail {

namespace {

// Which operand's NaN ATen's fp32 mul gives where both are NaN, by the loop's kind (0: every
// operand contiguous; 1, 2: the first or second operand a scalar; 3: strided, ATen's scalar
// loop) and an element's place in one inner-loop call of n elements: `main` in the vector
// loop (a call's first n - n % period elements), tail[n % period][j] for the j-th after it.
struct LoopNanPattern {
  int64_t period = 0;
  bool main = false;
  std::vector<std::vector<uint8_t>> tail;
  bool first(int64_t n, int64_t i) const {
    const int64_t r = n % period;
    return i < n - r ? main : tail[r][i - (n - r)] != 0;
  }
};

constexpr uint32_t kNanA = 0x7f800001u, kNanB = 0xffc00002u;  // signalling +NaN, quiet -NaN

// ATen's own answers for calls of 1..kProbe elements (serial: far below its parallel grain),
// and the smallest period that explains all of them. None if no period up to 128 does, or if
// where the operands lie in memory changes the answer.
std::optional<std::array<LoopNanPattern, 4>> probe_mul_nan_order() {
  constexpr int64_t kProbe = 384;
  auto filled = [](int64_t n, uint32_t bits) {
    at::Tensor t = at::empty({std::max<int64_t>(n, 1)}, at::TensorOptions().dtype(at::kFloat));
    for (int64_t i = 0; i < n; ++i) std::memcpy(t.data_ptr<float>() + i, &bits, 4);
    return t;
  };
  std::array<LoopNanPattern, 4> out;
  for (int kind = 0; kind < 4; ++kind) {
    std::vector<std::vector<uint8_t>> seen(kProbe + 1);
    for (int64_t n = 1; n <= kProbe; ++n) {
      for (int64_t shift : {0, 1}) {  // an aligned call and one a float further on
        if (shift && kind != 0) continue;
        at::Tensor a = kind == 1 ? filled(1, kNanA).reshape({}) : kind == 3 ? filled(2 * n, kNanA).slice(0, 0, 2 * n, 2)
                                                                             : filled(n + shift, kNanA).slice(0, shift);
        at::Tensor b = kind == 2 ? filled(1, kNanB).reshape({}) : filled(n + shift, kNanB).slice(0, shift);
        at::Tensor o = at::empty({n + shift}, at::TensorOptions().dtype(at::kFloat)).slice(0, shift);
        at::cpu::mul_out(o, a, b);
        std::vector<uint8_t> got(n);
        for (int64_t i = 0; i < n; ++i) {
          uint32_t bits;
          std::memcpy(&bits, o.const_data_ptr<float>() + i, 4);
          if (bits != (kNanA | 0x400000u) && bits != kNanB) return std::nullopt;
          got[i] = bits != kNanB;
        }
        if (shift && got != seen[n]) return std::nullopt;
        seen[n] = std::move(got);
      }
    }
    bool found = false;
    for (int64_t period = 1; period <= 128 && !found; period *= 2) {
      LoopNanPattern p;
      p.period = period;
      p.tail.assign(period, {});
      bool ok = true, have_main = false;
      for (int64_t n = 1; n <= kProbe && ok; ++n) {
        const int64_t r = n % period;
        if (p.tail[r].empty()) p.tail[r].assign(seen[n].end() - r, seen[n].end());
        ok = std::equal(p.tail[r].begin(), p.tail[r].end(), seen[n].end() - r);
        for (int64_t i = 0; ok && i < n - r; ++i) {
          if (!have_main) p.main = seen[n][i], have_main = true;
          ok = (seen[n][i] != 0) == p.main;
        }
      }
      if (ok) out[kind] = std::move(p), found = true;
    }
    if (!found) return std::nullopt;
  }
  return out;
}

const std::optional<std::array<LoopNanPattern, 4>>& mul_nan_patterns() {
  static const auto patterns = probe_mul_nan_order();
  return patterns;
}

}  // namespace

bool mul_nan_order_known() { return mul_nan_patterns().has_value(); }

EagerNanOrder::EagerNanOrder(Operand out, Operand a, Operand b)
    : out_(std::move(out)), a_(std::move(a)), b_(std::move(b)),
      ranges_(eager_ranges(c10::multiply_integers(out_.sizes))) {}

void EagerNanOrder::build() const {
  // Eager's mul built its TensorIterator from these operands: build it again for its dim
  // order, coalesced shape and strides. Over CPU tensors that only describe the operands (a
  // TensorIterator over meta tensors skips coalescing), on a buffer nobody reads: building an
  // iterator touches no element.
  static float nowhere[1];
  auto make = [&](const Operand& o) {
    return at::from_blob(nowhere, o.sizes, o.strides, at::TensorOptions().dtype(at::kFloat));
  };
  at::Tensor out = make(out_), a = make(a_), b = make(b_);
  at::TensorIterator iter = at::TensorIteratorConfig()
                                .set_check_mem_overlap(false)
                                .add_output(out)
                                .add_const_input(a)
                                .add_const_input(b)
                                .build();
  shape_ = iter.shape().vec();
  for (int k = 0; k < 3; ++k) strides_[k] = iter.strides(k).vec();
  for (int d = 0; d < int(shape_.size()); ++d) {
    if (shape_[d] > 1) by_out_stride_.push_back(d);
  }
  std::sort(by_out_stride_.begin(), by_out_stride_.end(),
            [&](int x, int y) { return strides_[0][x] > strides_[0][y]; });
  // The inner loop's kind, as ATen's VectorizedLoop2d picks it from the dim-0 strides.
  int64_t s[3] = {0, 0, 0};
  if (!shape_.empty()) {
    for (int k = 0; k < 3; ++k) s[k] = strides_[k][0];
  }
  kind_ = s[0] == 4 && s[1] == 4 && s[2] == 4   ? 0
          : s[0] == 4 && s[1] == 0 && s[2] == 4 ? 1
          : s[0] == 4 && s[1] == 4 && s[2] == 0 ? 2
                                                : 3;
  TORCH_CHECK(iter.numel() == ranges_.back().second, "neuron: internal error: eager's iteration size");
}

int64_t EagerNanOrder::offset(const int64_t* coords, int ncoords) const {
  const int rank = int(out_.sizes.size());
  int64_t off = 0;
  for (int m = 0; m < rank; ++m) {
    const int c = ncoords - rank + m;  // the output's dims are the run shape's last ones
    if (c >= 0 && out_.sizes[m] != 1) off += coords[c] * out_.strides[m];
  }
  return off;
}

bool EagerNanOrder::first(int64_t offset) const {
  std::call_once(once_, [this] { build(); });
  // The element's index in the iterator's order, from its output offset (outputs never
  // overlap themselves, so the largest stride first takes each coordinate).
  int64_t rem = offset * 4, linear = 0, c0 = 0;
  std::vector<int64_t> coord(shape_.size(), 0);
  for (int d : by_out_stride_) {
    coord[d] = rem / strides_[0][d];
    rem -= coord[d] * strides_[0][d];
  }
  TORCH_CHECK(rem == 0, "neuron: internal error: an output offset outside eager's iteration");
  for (int d = int(shape_.size()) - 1; d >= 0; --d) linear = linear * shape_[d] + coord[d];
  if (!shape_.empty()) c0 = coord[0];
  // Its inner-loop call: the row of dim 0 it lies in, cut by the thread's range.
  const int64_t row = shape_.empty() ? linear : linear - c0;
  const int64_t len = shape_.empty() ? 1 : shape_[0];
  for (const auto& [begin, end] : ranges_) {
    if (linear < begin || linear >= end) continue;
    const int64_t start = std::max(begin, row), stop = std::min(end, row + len);
    return (*mul_nan_patterns())[kind_].first(stop - start, linear - start);
  }
  TORCH_CHECK(false, "neuron: internal error: an element outside eager's thread ranges");
}

std::optional<ExactOp> decode_exact(const c10::FunctionSchema& s, const std::vector<int>& view,
                                    const std::vector<const IValue*>& constant, int out,
                                    const std::function<bool(int)>& is_float) {
  // The caller passes ops exact_op (launch.cpp) accepted: add/sub with alpha 1, true division,
  // x ** 2, fp32 exp where exp_joins_runs. (sqrt and rsqrt stay on ATen: of a negative number
  // its kernels give +NaN, the CPU's instruction -NaN.)
  using C = ExactRun::Code;
  static const std::unordered_map<std::string, std::pair<C, bool>> codes = {
      {"aten::add", {C::kAdd, true}}, {"aten::sub", {C::kSub, true}}, {"aten::mul", {C::kMul, true}},
      {"aten::div", {C::kDiv, true}}, {"aten::pow", {C::kSquare, false}}, {"aten::neg", {C::kNeg, false}},
      {"aten::abs", {C::kAbs, false}}, {"aten::reciprocal", {C::kReciprocal, false}},
      {"aten::exp", {C::kExp, false}}};
  auto it = codes.find(s.name());
  if (it == codes.end() || out < 0 || !is_float(out) || view.empty()) return std::nullopt;
  if (it->second.first == C::kMul && !mul_nan_order_known()) return std::nullopt;
  ExactOp op;
  op.code = it->second.first;
  op.out = out;
  auto operand = [&](size_t i, int& v, float& sc) {
    if (i >= view.size()) return false;
    if (view[i] >= 0) {
      v = view[i];
      return is_float(v);
    }
    return scalar_of(constant[i], sc);
  };
  bool ok = it->second.second
                ? operand(0, op.a, op.sa) && operand(1, op.b, op.sb) && (op.a >= 0 || op.b >= 0)
                : view[0] >= 0 && operand(0, op.a, op.sa);
  if (!ok) return std::nullopt;
  return op;
}

void model_nan_order(ExactOp& op, const std::function<EagerNanOrder::Operand(int)>& operand) {
  auto may_be_nan = [](int view, float scalar) { return view >= 0 || scalar != scalar; };
  if (op.code != ExactRun::kMul || !may_be_nan(op.a, op.sa) || !may_be_nan(op.b, op.sb)) return;
  auto of = [&](int view) { return view >= 0 ? operand(view) : EagerNanOrder::Operand{}; };
  op.nan_order = std::make_shared<const EagerNanOrder>(of(op.out), of(op.a), of(op.b));
}

std::vector<ExactRun> make_runs(const std::vector<ExactStepInfo>& steps, const std::vector<int>& value_of,
                                const std::vector<std::set<int>>& touched, const std::vector<bool>& dead) {
  const int n_values = int(dead.size());
  std::vector<ExactRun> runs;
  const size_t n = steps.size();
  size_t i = 0;
  while (i < n) {
    if (!steps[i].op) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < n && steps[j].op && steps[j].shape_class == steps[i].shape_class &&
           int(j - i) < ExactRun::kMaxRegs) {
      ++j;
    }
    ExactRun r;
    r.by_row = steps[i].shape_class == kByRowClass;
    r.first = int(i);
    r.count = int(j - i);
    std::vector<int> reg_of(n_values, -1), mem_of(n_values, -1), last_write(n_values, -1);
    auto mem = [&](int view) {
      for (size_t k = 0; k < r.mem.size(); ++k) {
        if (r.mem[k] == view) return int(k);
      }
      r.mem.push_back(view);
      return int(r.mem.size()) - 1;
    };
    for (size_t k = i; k < j; ++k) {
      const ExactOp& op = *steps[k].op;
      auto src = [&](int view, float scalar) {
        ExactRun::Src s;
        if (view < 0) {
          s.kind = ExactRun::Src::kScalar;
          s.scalar = scalar;
          return s;
        }
        int v = value_of[view];
        if (reg_of[v] >= 0) {
          s.kind = ExactRun::Src::kReg;
          s.index = reg_of[v];
        } else {
          s.kind = ExactRun::Src::kMem;
          s.index = mem(view);
        }
        return s;
      };
      ExactRun::Ins ins;
      ins.code = op.code;
      ins.narrow = op.narrow;
      ins.nan_order = op.nan_order;
      ins.a = src(op.a, op.sa);
      ins.b = src(op.b, op.sb);
      ins.reg = r.regs++;
      int v = value_of[op.out];
      reg_of[v] = ins.reg;
      last_write[v] = int(r.ins.size());
      mem_of[v] = op.out;
      r.ins.push_back(ins);
    }
    // A value is stored by its last write in the run if the program may read it, or a step
    // after the run touches it.
    std::vector<bool> later(n_values, false);
    for (size_t k = j; k < n; ++k) {
      for (int v : touched[k]) later[v] = true;
    }
    for (int v = 0; v < n_values; ++v) {
      if (last_write[v] >= 0 && (!dead[v] || later[v])) r.ins[last_write[v]].store = mem(mem_of[v]);
    }
    runs.push_back(std::move(r));
    i = j;
  }
  return runs;
}

int64_t one_pass_ops(const std::vector<ExactRun>& runs) {
  int64_t n = 0;
  for (const auto& r : runs) n += r.count;
  return n;
}

namespace {

// A select by bit mask: no branch for the vectorizer (and both values are computed anyway).
inline float pick(bool c, float a, float b) {
  uint32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  const uint32_t m = 0u - uint32_t(c);
  const uint32_t r = (ia & m) | (ib & ~m);
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

// x * y, with ATen's vector loop's NaN of two: the second operand's (quieted). A lambda, so
// the loops below inline it.
constexpr auto product = [](float x, float y) { return pick(y != y, y + y, x * y); };

template <class F>
inline __attribute__((always_inline)) void binary(const float* A, float sa, const float* B, float sb, float* D, int n, F f) {
  if (A && B) {
#pragma omp simd
    for (int k = 0; k < n; ++k) D[k] = f(A[k], B[k]);
  } else if (A) {
#pragma omp simd
    for (int k = 0; k < n; ++k) D[k] = f(A[k], sb);
  } else if (B) {
#pragma omp simd
    for (int k = 0; k < n; ++k) D[k] = f(sa, B[k]);
  } else {
    const float x = f(sa, sb);
    for (int k = 0; k < n; ++k) D[k] = x;
  }
}

template <class F>
inline __attribute__((always_inline)) void unary(const float* A, float sa, float* D, int n, F f) {
  if (A) {
#pragma omp simd
    for (int k = 0; k < n; ++k) D[k] = f(A[k]);
  } else {
    const float x = f(sa);
    for (int k = 0; k < n; ++k) D[k] = x;
  }
}

// Each case is one IEEE operation per element, and the extension builds with
// -ffp-contract=off: no clone can contract a product into a fused multiply-add.
inline __attribute__((always_inline))
void compute_one(ExactRun::Code c, const float* A, float sa, const float* B, float sb, float* D, int n) {
  using C = ExactRun::Code;
  switch (c) {
    // Two NaN operands: ATen's kernels return other's (quieted) for +, - and self's for /,
    // whichever operand order the compiler picks for the instruction. (y + y quiets y.) For *
    // other's too, except in parts of its loop tails: runs give those eager's (nan_order).
    case C::kAdd: return binary(A, sa, B, sb, D, n, [](float x, float y) { return pick(y != y, y + y, x + y); });
    case C::kSub: return binary(A, sa, B, sb, D, n, [](float x, float y) { return pick(y != y, y + y, x - y); });
    case C::kMul: return binary(A, sa, B, sb, D, n, product);
    case C::kDiv: return binary(A, sa, B, sb, D, n, [](float x, float y) { return pick(x != x, x + x, x / y); });
    case C::kNeg: return unary(A, sa, D, n, [](float x) { return -x; });
    case C::kAbs: return unary(A, sa, D, n, [](float x) { return std::fabs(x); });
    case C::kSquare: return unary(A, sa, D, n, [](float x) { return x * x; });
    case C::kReciprocal: return unary(A, sa, D, n, [](float x) { return 1.0f / x; });
    case C::kExp: {
      if (A) return vml_exp(A, D, n);
      float x;
      vml_exp(&sa, &x, 1);
      for (int k = 0; k < n; ++k) D[k] = x;
      return;
    }
    case C::kRowSum:
    case C::kRowMean:
    case C::kRowMax:
      return;  // reductions: reduce_row
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void compute(ExactRun::Code c, const float* A, float sa, const float* B, float sb, float* D, int n) {
  compute_one(c, A, sa, B, sb, D, n);
}

// Rows g < gn of n elements each: operands A and B contiguous over the rows, or (null) the
// per-row scalars sa[g] and sb[g]. One call for a group of short rows instead of one per row.
__attribute__((target_clones("avx512f", "avx2", "default")))
void compute_rows(ExactRun::Code c, const float* A, const float* sa, const float* B, const float* sb,
                  float* D, int64_t gn, int n) {
  for (int64_t g = 0; g < gn; ++g) {
    compute_one(c, A ? A + g * n : nullptr, sa[g], B ? B + g * n : nullptr, sb[g], D + g * n, n);
  }
}

// The product as compute's kMul, also telling whether any element had two NaN operands
// (in the same pass: a second pass over the operands measured 2-4% slower on GELU).
__attribute__((target_clones("avx512f", "avx2", "default")))
bool mul_flagged(const float* A, float sa, const float* B, float sb, float* D, int n) {
  int bad = 0;
  if (A && B) {
#pragma omp simd reduction(| : bad)
    for (int k = 0; k < n; ++k) {
      const float x = A[k], y = B[k];
      bad |= (x != x) & (y != y);
      D[k] = product(x, y);
    }
    return bad != 0;
  }
  binary(A, sa, B, sb, D, n, product);
  // A scalar operand: pairs where it is NaN and so is the other.
  if ((!A && sa == sa) || (!B && sb == sb)) return false;
  const float* X = A ? A : B;
  if (!X) return true;
#pragma omp simd reduction(| : bad)
  for (int k = 0; k < n; ++k) bad |= X[k] != X[k];
  return bad != 0;
}

// A product segment element by element: each pair of NaNs gives the operand's NaN eager's
// loop gave there. coords: the segment's first element in the run's shape (its column last;
// a per-row value's output has no column to place it by).
void mul_with_nan_order(const EagerNanOrder& order, const float* A, float sa, const float* B, float sb,
                        float* D, int n, int64_t* coords, int ncoords) {
  const int64_t col0 = coords[ncoords - 1];
  for (int k = 0; k < n; ++k) {
    const float x = A ? A[k] : sa, y = B ? B[k] : sb;
    if (x == x || y == y) {
      D[k] = product(x, y);
      continue;
    }
    coords[ncoords - 1] = col0 + k;
    D[k] = order.first(order.offset(coords, ncoords)) ? x + x : y + y;  // x + x quiets x
  }
  coords[ncoords - 1] = col0;
}

int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(uint64_t(x - 1));
}

// A contiguous row's sum in the order ATen's fp32 sum kernel adds it (vectorized_inner_sum
// in SumKernel.cpp: L-lane vector loads into four interleaved accumulators, cascaded into
// four levels so that only partial sums of similar size meet, then the lanes, the scalar
// tail first, onto the output's zero). row_sum_matches_aten checks the order per width.
typedef float V8 __attribute__((vector_size(32)));

__attribute__((target_clones("avx2", "default")))
float aten_order_sum(const float* p, int64_t n) {
  constexpr int L = 8;
  using V = V8;
  auto add = [p](V& acc, int64_t v) {  // acc += vector v of the row
    V x;
    std::memcpy(&x, p + v * L, sizeof(V));
    acc += x;
  };
  const int64_t vecs = n / L, size = vecs / 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / 4);  // 4 levels
  const int64_t step = int64_t(1) << power, mask = step - 1;
  // Four interleaved accumulators (a) at level 0; levels 1-3 (b, c, d) take them over every
  // `step` vectors. Named variables, not arrays: they stay in registers.
  V a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  V c0 = {}, c1 = {}, c2 = {}, c3 = {}, d0 = {}, d1 = {}, d2 = {}, d3 = {};
  const V zero = {};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      add(a0, i * 4);
      add(a1, i * 4 + 1);
      add(a2, i * 4 + 2);
      add(a3, i * 4 + 3);
    }
    b0 += a0, b1 += a1, b2 += a2, b3 += a3;
    a0 = a1 = a2 = a3 = zero;
    if ((i & (mask << power)) != 0) continue;
    c0 += b0, c1 += b1, c2 += b2, c3 += b3;
    b0 = b1 = b2 = b3 = zero;
    if ((i & (mask << (2 * power))) != 0) continue;
    d0 += c0, d1 += c1, d2 += c2, d3 += c3;
    c0 = c1 = c2 = c3 = zero;
  }
  for (; i < size; ++i) {
    add(a0, i * 4);
    add(a1, i * 4 + 1);
    add(a2, i * 4 + 2);
    add(a3, i * 4 + 3);
  }
  a0 += b0, a0 += c0, a0 += d0;
  a1 += b1, a1 += c1, a1 += d1;
  a2 += b2, a2 += c2, a2 += d2;
  a3 += b3, a3 += c3, a3 += d3;
  V acc[4] = {a0, a1, a2, a3};
  for (int64_t v = size * 4; v < vecs; ++v) add(acc[0], v);
  for (int k = 1; k < 4; ++k) acc[0] += acc[k];
  float total = 0;
  for (int64_t k = vecs * L; k < n; ++k) total += p[k];
  for (int k = 0; k < L; ++k) total += acc[0][k];
  return 0.0f + total;
}

// ATen's own kernel on one row: for results whose bits the fast paths cannot promise (a NaN's
// payload depends on the order operands met; so does the sign of a zero maximum).
float aten_row(ExactRun::Code c, const float* p, int64_t n) {
  at::Tensor x = at::from_blob(const_cast<float*>(p), {1, n}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor out = at::empty({1, 1}, at::TensorOptions().dtype(at::kFloat));
  const std::vector<int64_t> last{-1};
  if (c == ExactRun::kRowSum) at::cpu::sum_out(out, x, last, true);
  else if (c == ExactRun::kRowMean) at::cpu::mean_out(out, x, last, true);
  else at::cpu::amax_out(out, x, last, true);
  return *out.const_data_ptr<float>();
}

// The largest value of a row, and whether it holds a NaN.
__attribute__((target_clones("avx512f", "avx2", "default")))
float row_max(const float* p, int64_t n, bool& nan) {
  typedef int32_t M8 __attribute__((vector_size(32)));
  const float inf = std::numeric_limits<float>::infinity();
  V8 m0 = {-inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf}, m1 = m0;
  M8 bad = {};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    V8 x, y;
    std::memcpy(&x, p + k, sizeof(V8));
    std::memcpy(&y, p + k + 8, sizeof(V8));
    bad |= (x != x) | (y != y);
    m0 = x > m0 ? x : m0;
    m1 = y > m1 ? y : m1;
  }
  m0 = m1 > m0 ? m1 : m0;
  float best = -inf;
  for (int l = 0; l < 8; ++l) {
    nan = nan || bad[l] != 0;
    best = m0[l] > best ? m0[l] : best;
  }
  for (; k < n; ++k) {
    nan = nan || p[k] != p[k];
    best = p[k] > best ? p[k] : best;
  }
  return best;
}

float reduce_row(ExactRun::Code c, const float* p, int64_t n) {
  if (c == ExactRun::kRowMax) {
    bool nan = false;
    const float best = row_max(p, n, nan);
    // Without NaNs the maximum is one value whatever the order, except between -0.0 and 0.0.
    return nan || best == 0 ? aten_row(c, p, n) : best;
  }
  const float sum = aten_order_sum(p, n);
  if (sum != sum) return aten_row(c, p, n);
  return c == ExactRun::kRowMean ? sum / static_cast<float>(n) : sum;
}

}  // namespace

bool row_sum_matches_aten(int64_t width) {
  static std::mutex mu;
  static std::unordered_map<int64_t, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(width);
  if (it != known.end()) return it->second;
  // Rows whose sums round differently in any other order: values spread over 2^40 with
  // both signs (a fixed sequence, so the verdict is the same in every process).
  const int64_t rows = 6;
  at::Tensor x = at::empty({rows, width}, at::TensorOptions().dtype(at::kFloat));
  float* px = x.data_ptr<float>();
  uint32_t state = 12345u;
  for (int64_t i = 0; i < rows * width; ++i) {
    state = state * 1664525u + 1013904223u;
    const float mant = 1.0f + float(state >> 9) / float(1u << 23);
    const int e = int((state >> 3) % 41) - 20;
    px[i] = std::ldexp((state & 1) ? -mant : mant, e);
  }
  at::Tensor want = at::empty({rows, 1}, at::TensorOptions().dtype(at::kFloat));
  at::cpu::sum_out(want, x, std::vector<int64_t>{-1}, true);
  bool ok = width >= 8;
  for (int64_t r = 0; ok && r < rows; ++r) {
    const float got = aten_order_sum(px + r * width, width);
    ok = std::memcmp(&got, want.const_data_ptr<float>() + r, 4) == 0;
  }
  known.emplace(width, ok);
  return ok;
}

void run_exact(const ExactRun& r, const ExactPlace* places, const int64_t* rows, int nrows, int64_t width,
               const ExactOrigin& origin) {
  using C = ExactRun::Code;
  // Each instruction works on a segment of a row: a tile, or (by_row) the whole row, which
  // reductions need and which per-row values are computed once for. By-row runs take short
  // rows in groups, instruction by instruction: an op whose operands lie contiguous over the
  // group's rows is one call (MKL's exp has a per-call cost; on rows of 64 a call per row cost
  // more than the fusion saved), and one with per-row scalars one call looping over the rows.
  const int64_t seg = r.by_row ? width : kTile;
  const int64_t G = r.by_row ? std::clamp<int64_t>(kGroupElems / std::max<int64_t>(width, 1), 1, kMaxGroup) : 1;
  const size_t m = r.mem.size();
  TORCH_CHECK(m <= 64, "neuron: internal error: too many operands in an exact run");
  thread_local std::vector<float> storage;
  thread_local std::vector<float*> row_ptrs;
  const size_t need = size_t(r.regs + 2) * size_t(G * seg) + 16;
  if (storage.size() < need) storage.resize(need);
  if (row_ptrs.size() < size_t(G) * m) row_ptrs.resize(size_t(G) * m);
  float* base = storage.data() + (16 - (reinterpret_cast<uintptr_t>(storage.data()) / 4) % 16) % 16;
  auto reg_at = [&](int q, int64_t g) { return base + (size_t(q) * G + g) * seg; };
  float* at[ExactRun::kMaxRegs][kMaxGroup];  // each register's segment per row: its own, or stored memory
  float val[ExactRun::kMaxRegs][kMaxGroup];  // narrow registers' values per row
  bool narrow[ExactRun::kMaxRegs] = {};
  for (const auto& in : r.ins) narrow[in.reg] = in.narrow;
  // Rows too short for the hardware prefetcher to get ahead of a by-row run's memory traffic
  // are prefetched in software, about 4 KiB ahead of each contiguous operand (prefetches never
  // fault). Not where the row's arithmetic includes exp: that takes long enough for the
  // hardware prefetcher, and software prefetches would only take issue slots (softmax
  // written out: 3.72 ms without them, 3.83 ms with).
  bool prefetch = r.by_row && nrows > 0;
  for (const auto& in : r.ins) prefetch = prefetch && in.code != C::kExp;

  int64_t total = 1;
  for (int d = 0; d < nrows; ++d) total *= rows[d];
  int64_t idx[kMaxRowDims] = {};
  int64_t at_row[kMaxGroup][kMaxRowDims];  // each group row's index in the run's full shape
  // A segment's first element in the run's full shape (rows, then the column), for products
  // whose operands are both NaN.
  auto coords_of = [&](int64_t g, int64_t col, int64_t* c) {
    for (int d = 0; d < nrows; ++d) c[d] = at_row[g][d];
    c[nrows] = origin.col + col;
    return nrows + 1;
  };
  for (int64_t row0 = 0; row0 < total; row0 += G) {
    const int64_t gn = std::min(G, total - row0);
    for (int64_t g = 0; g < gn; ++g) {
      for (int d = 0; d < nrows; ++d) at_row[g][d] = origin.row[d] + idx[d];
      float** row_ptr = &row_ptrs[g * m];
      for (size_t p = 0; p < m; ++p) {
        int64_t off = 0;
        for (int d = 0; d < nrows; ++d) off += idx[d] * places[p].row[d];
        row_ptr[p] = places[p].ptr + off;
      }
      if (prefetch) {
        const int64_t ahead = std::max<int64_t>(1, 4096 / (width * 4));
        for (size_t p = 0; p < m; ++p) {
          const int64_t stride = places[p].row[nrows - 1];
          if (places[p].col != 1 || stride == 0) continue;
          const char* q = reinterpret_cast<const char*>(row_ptr[p] + ahead * stride);
          for (int64_t b = 0; b < width * 4; b += 64) __builtin_prefetch(q + b);
        }
      }
      for (int d = nrows - 1; d >= 0; --d) {
        if (++idx[d] < rows[d]) break;
        idx[d] = 0;
      }
    }
    for (int64_t j0 = 0; j0 < width; j0 += seg) {
      const int64_t n = std::min<int64_t>(seg, width - j0);
      for (const auto& in : r.ins) {
        // Operand s of row g: a pointer to its n elements, or (null) the scalar in sc.
        auto fetch = [&](const ExactRun::Src& s, int64_t g, int slot, float& sc) -> const float* {
          switch (s.kind) {
            case ExactRun::Src::kReg:
              if (narrow[s.index]) {
                sc = val[s.index][g];
                return nullptr;
              }
              return at[s.index][g];
            case ExactRun::Src::kScalar:
              sc = s.scalar;
              return nullptr;
            default: {
              const ExactPlace& P = places[s.index];
              const float* p = row_ptrs[g * m + s.index];
              if (P.col == 1) return p + j0;
              if (P.col == 0) {
                sc = p[0];
                return nullptr;
              }
              float* t = reg_at(r.regs + slot, g);
              for (int64_t k = 0; k < n; ++k) t[k] = p[(j0 + k) * P.col];
              return t;
            }
          }
        };
        if (in.code >= C::kRowSum || in.narrow) {
          float sa[kMaxGroup], sb[kMaxGroup];
          for (int64_t g = 0; g < gn; ++g) {
            const float* A = fetch(in.a, g, 0, sa[g]);
            if (in.code >= C::kRowSum) {
              if (!A) {  // a row of one value repeated (an expanded tensor)
                float* t = reg_at(r.regs, g);
                std::fill(t, t + n, sa[g]);
                A = t;
              }
              val[in.reg][g] = reduce_row(in.code, A, n);
            } else {
              const float* B = fetch(in.b, g, 1, sb[g]);
              TORCH_CHECK(!A && !B, "neuron: internal error: a per-row value computed from a whole row");
            }
          }
          // Per-row values of the group: one call over its rows' scalars (products that may
          // meet two NaNs row by row).
          if (in.nan_order) {
            for (int64_t g = 0; g < gn; ++g) {
              int64_t c[kMaxRowDims + 1];
              const int nc = coords_of(g, 0, c);
              mul_with_nan_order(*in.nan_order, nullptr, sa[g], nullptr, sb[g], &val[in.reg][g], 1, c, nc);
            }
          } else if (in.code < C::kRowSum) {
            compute_rows(in.code, nullptr, sa, nullptr, sb, val[in.reg], gn, 1);
          }
          if (in.store >= 0) {
            for (int64_t g = 0; g < gn; ++g) row_ptrs[g * m + in.store][0] = val[in.reg][g];
          }
          continue;
        }
        // A stored contiguous result is computed in place: in-run readers take it from there.
        const bool direct = in.store >= 0 && places[in.store].col == 1;
        const float* A[kMaxGroup];
        const float* B[kMaxGroup];
        float sa[kMaxGroup], sb[kMaxGroup];
        // Over the group: one call if every operand lies contiguous over its rows or is one
        // scalar for all; one call looping over rows if some are per-row scalars; else per row.
        bool whole = gn > 1, rowwise = gn > 1;
        for (int64_t g = 0; g < gn; ++g) {
          A[g] = fetch(in.a, g, 0, sa[g]);
          B[g] = fetch(in.b, g, 1, sb[g]);
          at[in.reg][g] = direct ? row_ptrs[g * m + in.store] + j0 : reg_at(in.reg, g);
          auto contiguous = [&](const float* const* v) { return v[0] && v[g] == v[0] + g * n; };
          auto same = [&](const float* const* v, const float* s) {
            return !v[0] && !v[g] && std::memcmp(&s[g], &s[0], 4) == 0;
          };
          auto scalars = [&](const float* const* v) { return !v[0] && !v[g]; };
          const bool out = at[in.reg][g] == at[in.reg][0] + g * n;
          whole = whole && out && (contiguous(A) || same(A, sa)) && (contiguous(B) || same(B, sb));
          rowwise = rowwise && out && (contiguous(A) || scalars(A)) && (contiguous(B) || scalars(B));
        }
        if (in.nan_order) {
          // Products whose operands may both be NaN: rows where some are go again element by
          // element. (Their operands are intact: a run's output never is an operand's memory,
          // since in-place ops stay ATen calls.)
          bool redo[kMaxGroup] = {};
          if (whole) {
            std::fill(redo, redo + gn, mul_flagged(A[0], sa[0], B[0], sb[0], at[in.reg][0], int(gn * n)));
          } else {
            for (int64_t g = 0; g < gn; ++g) redo[g] = mul_flagged(A[g], sa[g], B[g], sb[g], at[in.reg][g], int(n));
          }
          for (int64_t g = 0; g < gn; ++g) {
            if (!redo[g]) continue;
            int64_t c[kMaxRowDims + 1];
            const int nc = coords_of(g, j0, c);
            mul_with_nan_order(*in.nan_order, A[g], sa[g], B[g], sb[g], at[in.reg][g], int(n), c, nc);
          }
        } else if (whole) {
          compute(in.code, A[0], sa[0], B[0], sb[0], at[in.reg][0], int(gn * n));
        } else if (rowwise) {
          compute_rows(in.code, A[0], sa, B[0], sb, at[in.reg][0], gn, int(n));
        } else {
          for (int64_t g = 0; g < gn; ++g) compute(in.code, A[g], sa[g], B[g], sb[g], at[in.reg][g], int(n));
        }
        if (in.store >= 0 && !direct) {
          // Written values have the run's full shape: a column stride of 0 means width 1.
          for (int64_t g = 0; g < gn; ++g) {
            float* p = row_ptrs[g * m + in.store];
            for (int64_t k = 0; k < n; ++k) p[(j0 + k) * places[in.store].col] = at[in.reg][g][k];
          }
        }
      }
    }
  }
}

}  // namespace neuron::fusion::detail
