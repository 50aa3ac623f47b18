// Adaptive Eager rows windows: pointwise ops with broadcast operands, reductions over the
// last dim and concatenation along it, over tensors that share their leading (row) dims,
// run as one kernel over blocks of whole rows. A reduction sees each row whole (ATen
// reduces a contiguous row by itself, whatever the rest of the tensor holds), and each op
// on a block is ATen's own CPU kernel, run serially inside the kernel's parallel loop.
// Ops whose bits depend on ATen's vector/scalar split join only where ATen, run on each
// block, meets every element in the loop eager met it in (see loops_match_eager).
#include "fusion_internal.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Contiguity.h>

#include <algorithm>
#include <array>
#include <map>
#include <set>

namespace neuron::fusion::detail {

namespace {
// Elements of the widest operand per block: the chain's blocks stay in cache, and ATen's
// per-call cost (a few microseconds per op) stays small next to a block's work.
constexpr int64_t kRowBlock = 131072;
// Every vectorized loop's stride (2 vectors of 64 bytes, for 1-byte dtypes 128 elements)
// divides it: a loop started this many elements later lines its vectors up the same way.
constexpr int64_t kAlign = 128;

struct RowPlan {
  struct Val {
    c10::Storage storage;  // live values: the device memory, as a CPU storage
    bool dead = false;
    int slot = -1;  // dead values: the scratch buffer
  };
  struct View {
    int val;
    c10::ScalarType dtype;
    std::vector<int64_t> sizes, strides;
    int64_t offset;
    int shift;
  };
  struct Arg {
    int view = -1;
    bool list = false;
    std::vector<int> views;  // a tensor list
    IValue constant;
  };
  struct Step {
    c10::OperatorHandle kernel;
    bool use_out;
    std::vector<Arg> args;
    int out = -1;
  };
  std::vector<Val> vals;
  std::vector<View> views;
  std::vector<Step> steps;
  std::vector<std::set<int>> touched;  // per step: the values it reads or writes
  std::vector<ExactRun> runs;
  std::vector<std::vector<int64_t>> run_shape;  // each run's iteration shape
  std::vector<int> run_at;                      // per step: the run starting there, or -1
  std::vector<bool> folded;                     // per step: a cat its inputs' runs wrote
  std::vector<int64_t> rows;  // the leading dims all operands share
  int bd = 0;                 // blocks cut this dim (all dims before it are taken one by one)
  int64_t len = 1, per_outer = 1, blocks = 0, numel = 0;

  // Block b: an index into the dims before bd, and rows [t0, t1) of dim bd.
  void block(int64_t b, int64_t* idx, int64_t& t0, int64_t& t1) const {
    int64_t o = b / per_outer;
    t0 = (b % per_outer) * len;
    t1 = std::min(t0 + len, rows[bd]);
    for (int m = bd - 1; m >= 0; --m) {
      idx[m] = o % rows[m];
      o /= rows[m];
    }
  }
  // View v narrowed to a block: its sizes and storage offset.
  int64_t narrow(const View& v, const int64_t* idx, int64_t t0, int64_t t1, int64_t* sizes) const {
    int64_t off = v.offset;
    for (size_t j = 0; j < v.sizes.size(); ++j) {
      sizes[j] = v.sizes[j];
      int64_t m = int64_t(j) + v.shift;
      if (m > bd || v.sizes[j] == 1) continue;
      if (m < bd) {
        off += idx[m] * v.strides[j];
        sizes[j] = 1;
      } else {
        off += t0 * v.strides[j];
        sizes[j] = t1 - t0;
      }
    }
    return off;
  }
};

bool contiguous(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  return c10::_compute_contiguous<int64_t>(sizes, strides, c10::multiply_integers(sizes));
}

// Widest rows a by-row run takes: its registers hold whole rows (16 of them, 256 KiB).
constexpr int64_t kMaxRowRunWidth = 4096;

// A last-dim fp32 sum, mean or amax with keepdim, as a by-row run's instruction.
std::optional<ExactOp> decode_reduction(const RowPlan& p, const RowPlan::Step& st,
                                        const std::vector<int64_t>& shape) {
  using C = ExactRun::Code;
  static const std::map<std::string, C> codes = {
      {"aten::sum", C::kRowSum}, {"aten::mean", C::kRowMean}, {"aten::amax", C::kRowMax}};
  const auto it = codes.find(st.kernel.schema().name());
  const size_t nargs = it == codes.end() ? 0 : it->second == C::kRowMax ? 3 : 4;
  if (!nargs || !st.use_out || st.args.size() != nargs || st.args[0].view < 0) return std::nullopt;
  const RowPlan::View& in = p.views[st.args[0].view];
  const RowPlan::View& out = p.views[st.out];
  std::vector<int64_t> narrow = shape;
  narrow.back() = 1;
  if (in.dtype != c10::kFloat || out.dtype != c10::kFloat || in.shift != 0 || in.sizes != shape ||
      out.shift != 0 || out.sizes != narrow) {
    return std::nullopt;
  }
  const IValue& dim = st.args[1].constant;
  const IValue& keepdim = st.args[2].constant;
  if (!dim.isIntList() || dim.toIntList().size() != 1 || !keepdim.isBool() || !keepdim.toBool()) {
    return std::nullopt;
  }
  const int64_t d = dim.toIntList()[0];
  if (d != -1 && d != int64_t(shape.size()) - 1) return std::nullopt;
  if (nargs == 4) {
    const IValue& dtype = st.args[3].constant;
    if (!(dtype.isNone() || (dtype.isInt() && dtype.toInt() == int64_t(c10::kFloat)))) return std::nullopt;
    if (!row_sum_matches_aten(shape.back())) return std::nullopt;
  }
  ExactOp op;
  op.code = it->second;
  op.a = st.args[0].view;
  op.out = st.out;
  op.narrow = true;
  return op;
}

// Stretches of exact fp32 pointwise steps of one iteration shape run as one pass over each
// block. Their operands broadcast right-aligned to that shape. Where rows are narrow enough,
// steps over whole rows, over per-row values and last-dim reductions between them form one
// by-row run instead: each row's values then stay in L1 from the first step to the last.
void plan_exact_runs(RowPlan& p, const std::vector<Op>& ops, const std::vector<int64_t>& shape) {
  std::vector<int64_t> narrow = shape;
  narrow.back() = 1;
  const bool by_row = shape.back() > 1 && shape.back() <= kMaxRowRunWidth &&
                      shape.size() <= size_t(kMaxRowDims) + 1;
  std::vector<ExactStepInfo> info(p.steps.size());
  std::vector<bool> row_step(p.steps.size(), false);  // could join a by-row run
  std::map<std::vector<int64_t>, int> classes;
  auto is_float = [&](int v) { return p.views[v].dtype == c10::kFloat; };
  for (size_t k = 0; k < p.steps.size(); ++k) {
    const RowPlan::Step& st = p.steps[k];
    std::vector<int> view;
    std::vector<const IValue*> constant;
    bool aligned = st.out >= 0 && ops[k].shape.size() <= size_t(kMaxRowDims) + 1;
    auto see = [&](int v) {
      const auto& w = p.views[v];
      aligned = aligned && w.shift + int(w.sizes.size()) == int(ops[k].shape.size());
    };
    for (const auto& a : st.args) {
      if (a.list) {
        for (int v : a.views) see(v);
        aligned = false;
      }
      if (a.view >= 0) see(a.view);
      view.push_back(a.list ? -2 : a.view);
      constant.push_back(a.view >= 0 || a.list ? nullptr : &a.constant);
    }
    if (st.out >= 0) see(st.out);
    // The written view holds the whole iteration shape.
    aligned = aligned && p.views[st.out].sizes == ops[k].shape;
    auto c = classes.emplace(ops[k].shape, int(classes.size())).first;
    info[k].shape_class = c->second;
    if (ops[k].exact && aligned) info[k].op = decode_exact(st.kernel.schema(), view, constant, st.out, is_float);
    if (info[k].op) {
      model_nan_order(*info[k].op, [&](int v) { return EagerNanOrder::Operand{p.views[v].sizes, p.views[v].strides}; });
    }
    if (!by_row) continue;
    if (info[k].op && (ops[k].shape == shape || ops[k].shape == narrow)) {
      info[k].op->narrow = ops[k].shape == narrow;
    } else if (!info[k].op && ops[k].exact) {
      info[k].op = decode_reduction(p, st, shape);
      if (!info[k].op) continue;
    } else {
      continue;
    }
    row_step[k] = true;
  }
  // Only stretches with a reduction go by row: for pointwise steps alone, tiles do the same
  // work with less per-row bookkeeping.
  for (size_t i = 0; i < info.size();) {
    size_t j = i;
    bool reduces = false;
    for (; j < info.size() && row_step[j]; ++j) reduces = reduces || info[j].op->code >= ExactRun::kRowSum;
    for (size_t k = i; k < j; ++k) {
      if (reduces) info[k].shape_class = kByRowClass;
      else info[k].op->narrow = false;
    }
    i = std::max(j, i + 1);
  }
  std::vector<int> value_of;
  for (const auto& v : p.views) value_of.push_back(v.val);
  std::vector<bool> dead;
  for (const auto& v : p.vals) dead.push_back(v.dead);
  p.runs = make_runs(info, value_of, p.touched, dead);
  p.run_at.assign(p.steps.size(), -1);
  for (size_t r = 0; r < p.runs.size(); ++r) {
    p.run_at[p.runs[r].first] = int(r);
    p.run_shape.push_back(p.runs[r].by_row ? shape : ops[p.runs[r].first].shape);
  }
}

bool same_view(const RowPlan::View& a, const RowPlan::View& b) {
  return a.val == b.val && a.sizes == b.sizes && a.strides == b.strides && a.offset == b.offset &&
         a.shift == b.shift && a.dtype == b.dtype;
}

// A last-dim cat of values only one-pass runs wrote, and only the cat reads, needs no copy: the
// runs store each input straight into its slice of the (live) output.
void fold_cats(RowPlan& p) {
  p.folded.assign(p.steps.size(), false);
  std::vector<int> touches(p.vals.size(), 0);  // steps touching each value
  for (const auto& values : p.touched) {
    for (int v : values) ++touches[v];
  }
  for (size_t k = 0; k < p.steps.size(); ++k) {
    const RowPlan::Step& st = p.steps[k];
    if (st.kernel.schema().name() != "aten::cat" || !st.use_out || st.args.empty() || !st.args[0].list) continue;
    const RowPlan::View out = p.views[st.out];  // a copy: slices are appended to p.views
    if (p.vals[out.val].dead || out.strides.empty() || out.dtype != c10::kFloat) continue;
    // Each input: the (run, instruction) storing it.
    const std::vector<int> inputs = st.args[0].views;
    std::vector<std::pair<int, int>> writers;
    std::set<int> seen;
    for (int vi : inputs) {
      const RowPlan::View& in = p.views[vi];
      if (!p.vals[in.val].dead || touches[in.val] != 2 || in.sizes.size() != out.sizes.size() ||
          !seen.insert(in.val).second) {
        break;
      }
      std::pair<int, int> w{-1, -1};
      for (size_t r = 0; r < p.runs.size() && p.runs[r].first + p.runs[r].count <= int(k); ++r) {
        for (size_t i = 0; i < p.runs[r].ins.size(); ++i) {
          const auto& ins = p.runs[r].ins[i];
          if (ins.store >= 0 && same_view(p.views[p.runs[r].mem[ins.store]], in)) w = {int(r), int(i)};
        }
      }
      if (w.first < 0) break;
      writers.push_back(w);
    }
    if (writers.size() != inputs.size()) continue;
    int64_t off = 0;
    for (size_t j = 0; j < writers.size(); ++j) {
      const int64_t w = p.views[inputs[j]].sizes.back();
      RowPlan::View slice = out;
      slice.sizes.back() = w;
      slice.offset = out.offset + off * out.strides.back();
      off += w;
      p.views.push_back(std::move(slice));
      ExactRun& run = p.runs[writers[j].first];
      run.mem.push_back(int(p.views.size()) - 1);
      run.ins[writers[j].second].store = int(run.mem.size()) - 1;
    }
    p.folded[k] = true;
  }
}

// Does ATen, run on each block, meet every element of this op in the same loop and the same
// place in it as eager did? That matters where its result bits depend on the loop (see
// Op::split_free). Two layouts qualify:
// - flat: every operand contiguous in the iteration shape (eager's loop calls are its thread
//   ranges): eager's split points must be block cuts, each cut a multiple of kAlign into
//   eager's range;
// - by row: the last dim does not coalesce with the rows (an operand broadcasts along one of
//   them), so eager's calls are whole rows, as the blocks' are, provided no thread range
//   starts inside a row;
// - strided: binary arithmetic (add, sub, mul, div: cpu_kernel_vec) reading an operand with a
//   step along the last dim (RoPE's x[..., ::2]). Its vector loop needs every operand
//   contiguous or a scalar along the innermost dim, which stays the last dim (the output is
//   row-major, rows whole), so eager's calls and the blocks' alike run the scalar loop on
//   every element. (Ops ATen maps through VML copy strided inputs into 8 KiB buffers first,
//   where an element's place does matter: not these.)
bool strided_scalar_loop(const Op& op, const std::vector<Ref>& refs) {
  static const std::set<std::string> binary = {"aten::add", "aten::sub", "aten::mul", "aten::div",
                                                "aten::add_", "aten::sub_", "aten::mul_", "aten::div_"};
  if (op.name == nullptr || !binary.count(op.name)) return false;
  const int R = int(op.shape.size());
  if (R < 1 || op.shape.back() < 2) return false;
  bool strided = false;
  for (const auto& r : refs) {
    const int j = R - 1 - r.shift;
    if (r.write) {
      if (!(r.sizes == op.shape && r.shift == 0 && contiguous(r.sizes, r.strides))) return false;
      continue;
    }
    if (j < 0 || j >= int(r.sizes.size()) || r.sizes[j] == 1) continue;   // a scalar along it
    strided = strided || (r.strides[j] != 1 && r.strides[j] != 0);
  }
  return strided;
}

// - aligned over outer broadcasts: every operand contiguous, of the iteration shape or
//   broadcast along leading dims only (a [S, D] table over [B, S, D]), so eager's loop calls
//   are its thread ranges cut every L elements (L the trailing extent all operands share).
//   With L, eager's range starts and the block cuts all multiples of kAlign, every call of
//   eager's and of the blocks' is a whole number of vectors long: every element is computed
//   in the vector loop both ways.
bool aligned_over_outer_broadcasts(const RowPlan& p, const Op& op, const std::vector<Ref>& refs) {
  const auto& O = op.shape;
  const int R = int(O.size());
  if (R < 2) return false;
  int M = 0;  // the first dim from which every operand has the whole size
  for (const auto& r : refs) {
    if (!contiguous(r.sizes, r.strides)) return false;
    if (r.write) {
      if (!(r.sizes == O && r.shift == 0)) return false;
      continue;
    }
    auto size = [&](int j) {
      const int jj = j - r.shift;
      return jj >= 0 && jj < int(r.sizes.size()) ? r.sizes[jj] : int64_t(1);
    };
    int m = R;
    while (m > 0 && size(m - 1) == O[m - 1]) --m;
    for (int j = 0; j < m; ++j) {
      if (size(j) != 1) return false;  // broadcast along a dim with whole dims before it
    }
    M = std::max(M, m);
  }
  if (M >= R) return false;
  int64_t L = 1;
  for (int j = M; j < R; ++j) L *= O[j];
  if (L % kAlign != 0) return false;
  for (const auto& r : eager_ranges(op.numel)) {
    if (r.first % kAlign != 0) return false;
  }
  int64_t inner_o = 1;
  for (size_t m = p.bd + 1; m < O.size(); ++m) inner_o *= O[m];
  for (int64_t b = 0; b < p.blocks; ++b) {
    const int64_t e = ((b / p.per_outer) * p.rows[p.bd] + (b % p.per_outer) * p.len) * inner_o;
    if (e % kAlign != 0) return false;
  }
  return true;
}

bool loops_match_eager(const RowPlan& p, const Op& op, const std::vector<Ref>& refs) {
  const auto& O = op.shape;
  if (strided_scalar_loop(op, refs)) return true;
  if (op.shape.size() == p.rows.size() + 1 && aligned_over_outer_broadcasts(p, op, refs)) return true;
  bool flat = true;
  for (const auto& r : refs) flat = flat && r.sizes == O && r.shift == 0 && contiguous(r.sizes, r.strides);
  const auto ranges = eager_ranges(op.numel);
  if (flat) {
    int64_t inner_o = 1;
    for (size_t m = p.bd + 1; m < O.size(); ++m) inner_o *= O[m];
    std::vector<int64_t> starts;
    for (const auto& r : ranges) starts.push_back(r.first);
    int64_t cuts_found = 0;
    for (int64_t b = 0; b < p.blocks; ++b) {
      int64_t e = ((b / p.per_outer) * p.rows[p.bd] + (b % p.per_outer) * p.len) * inner_o;
      size_t r = std::upper_bound(starts.begin(), starts.end(), e) - starts.begin() - 1;
      if ((e - starts[r]) % kAlign != 0) return false;
      cuts_found += e == starts[r];
    }
    return cuts_found == int64_t(starts.size());
  }
  const int R = int(O.size());
  if (R < 2 || O.back() < 2) return false;
  const int64_t W = O.back();
  // The innermost row dim of more than one row: the one the last dim would coalesce with.
  int q = R - 2;
  while (q >= 0 && O[q] == 1) --q;
  if (q < 0) return false;
  bool coalesces = true;
  for (const auto& r : refs) {
    // Operands broadcast right-aligned; the written one has the whole shape, row-major.
    if (r.write && !(r.sizes == O && r.shift == 0 && contiguous(r.sizes, r.strides))) return false;
    auto stride = [&](int m) {
      const int j = m - r.shift;
      return j >= 0 && j < int(r.sizes.size()) && r.sizes[j] != 1 ? r.strides[j] : 0;
    };
    coalesces = coalesces && stride(q) == stride(R - 1) * W;
  }
  if (coalesces) return false;
  for (const auto& r : ranges) {
    if (r.first % W != 0) return false;
  }
  return true;
}

// The rows kernel for a window, or null when it could not be bit-identical to eager.
std::shared_ptr<RowPlan> make_row_plan(std::vector<Op>& ops,
                                       const std::vector<std::vector<Ref>>& refs,
                                       const std::vector<int64_t>& shape) {
  auto p = std::make_shared<RowPlan>();
  const int k = int(shape.size()) - 1;
  p->rows.assign(shape.begin(), shape.begin() + k);
  int64_t width = 1;
  for (const auto& op : ops) {
    if (op.shape.size() == shape.size()) width = std::max(width, op.shape.back());
  }
  // Blocks: the outermost row dim whose slices fit a block, cut into runs of rows.
  std::vector<int64_t> inner(k);
  int64_t acc = width;
  for (int m = k - 1; m >= 0; --m) {
    inner[m] = acc;
    acc *= p->rows[m];
  }
  if (width > kRowBlock) return nullptr;  // one row does not fit: reductions need it whole
  p->bd = 0;
  while (inner[p->bd] > kRowBlock) ++p->bd;
  p->len = std::min(p->rows[p->bd], std::max<int64_t>(1, kRowBlock / inner[p->bd]));
  // Runs of a multiple of kAlign rows keep per-row values' vector loops lined up with eager.
  if (p->len > kAlign && p->len < p->rows[p->bd]) p->len -= p->len % kAlign;
  p->per_outer = (p->rows[p->bd] + p->len - 1) / p->len;
  int64_t outer = 1;
  for (int m = 0; m < p->bd; ++m) outer *= p->rows[m];
  p->blocks = outer * p->per_outer;
  p->numel = acc;

  // Liveness: a fresh output is dead if the program holds no reference to it and every
  // reference the window makes sees it in the place its op wrote it.
  Refs counts;
  count_refs(ops, counts);
  std::unordered_map<const void*, int> val_of;
  std::unordered_map<const void*, bool> dead;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i].use_out && !ops[i].overwrites) continue;
    const at::Tensor& written = ops[i].use_out ? ops[i].outs[0] : ops[i].args[ops[i].self].toTensor();
    const Ref& out = ops[i].use_out ? refs[i].back()
                                    : *std::find_if(refs[i].begin(), refs[i].end(), [](const Ref& r) { return r.write; });
    bool d = only_window_holds(written, counts) && contiguous(out.sizes, out.strides);
    for (const auto& rs : refs) {
      for (const auto& r : rs) d = d && (r.buf != out.buf || same_place(r, out));
    }
    dead[out.buf] = d;
  }
  int slots = 0;
  auto view_of = [&](const Ref& r, const at::Tensor& t) {
    auto it = val_of.find(r.buf);
    int v;
    if (it == val_of.end()) {
      v = int(p->vals.size());
      RowPlan::Val val;
      auto dd = dead.find(r.buf);
      val.dead = dd != dead.end() && dd->second;
      if (val.dead) val.slot = slots++;
      else val.storage = cpu_alias(t).storage();
      p->vals.push_back(std::move(val));
      val_of[r.buf] = v;
    } else {
      v = it->second;
    }
    p->views.push_back({v, r.dtype, r.sizes, r.strides, r.offset, r.shift});
    return int(p->views.size()) - 1;
  };
  for (size_t i = 0; i < ops.size(); ++i) {
    Op& op = ops[i];
    RowPlan::Step st{*op.kernel, op.use_out, {}, -1};
    size_t next = 0;
    for (size_t a = 0; a < op.args.size(); ++a) {
      const IValue& v = op.args[a];
      RowPlan::Arg arg;
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDevice) {
        arg.view = view_of(refs[i][next++], v.toTensor());
        if (int(a) == op.self) st.out = arg.view;
      } else if (v.isTensorList()) {
        arg.list = true;
        for (const IValue& e : v.toListRef()) arg.views.push_back(view_of(refs[i][next++], e.toTensor()));
      } else {
        arg.constant = v;
      }
      st.args.push_back(std::move(arg));
    }
    if (op.use_out) st.out = view_of(refs[i][next++], op.outs[0]);

    // An exact op that is not split-free is checked once runs are planned: in a run, where
    // its loops are modelled, it needs no more.
    if (!op.exact && !loops_match_eager(*p, op, refs[i])) return nullptr;
    p->steps.push_back(std::move(st));
  }
  for (const auto& v : p->views) {
    if (p->vals[v.val].dead && p->len * inner[p->bd] * c10::elementSize(v.dtype) > kChunk * 8) {
      return nullptr;
    }
  }
  for (const auto& s : p->steps) {
    p->touched.push_back({p->views[s.out].val});
    for (const auto& a : s.args) {
      if (a.view >= 0) p->touched.back().insert(p->views[a.view].val);
      for (int v : a.views) p->touched.back().insert(p->views[v].val);
    }
  }
  return p;
}

bool plan_gains(const RowPlan& p) {
  std::vector<bool> dead;
  for (const auto& v : p.vals) dead.push_back(v.dead);
  return saves_traffic(p.touched, dead);
}

// Run r over the current block: its shape narrowed as the block narrows the window.
void run_block(const RowPlan& p, int r, const std::vector<at::Tensor>& t, const int64_t* idx, int64_t t0,
               int64_t t1) {
  const ExactRun& run = p.runs[r];
  std::vector<int64_t> shape = p.run_shape[r];
  const int R = int(shape.size());
  for (int m = 0; m < R && m <= p.bd && m < int(p.rows.size()); ++m) shape[m] = m < p.bd ? 1 : t1 - t0;
  std::vector<ExactPlace> places(run.mem.size());
  for (size_t q = 0; q < run.mem.size(); ++q) {
    const at::Tensor& v = t[run.mem[q]];
    const int rank = int(v.dim());
    ExactPlace& pl = places[q];
    pl.ptr = static_cast<float*>(v.data_ptr());
    for (int m = 0; m < R; ++m) {
      int j = m - (R - rank);
      int64_t stride = (j >= 0 && v.size(j) != 1) ? v.stride(j) : 0;
      if (m == R - 1) pl.col = stride;
      else pl.row[m] = stride;
    }
  }
  ExactOrigin origin;
  // A run over per-row values without the last dim may have blocks cut its own last dim.
  for (int m = 0; m < R && m <= p.bd; ++m) (m < R - 1 ? origin.row[m] : origin.col) = m < p.bd ? idx[m] : t0;
  run_exact(run, places.data(), shape.data(), R - 1, shape[R - 1], origin);
}

void run_rows(const RowPlan& p) {
  at::parallel_for(0, p.blocks, 1, [&](int64_t b0, int64_t b1) {
    // One CPU tensor per view, re-pointed at each block.
    std::vector<at::Tensor> t(p.views.size());
    for (size_t i = 0; i < p.views.size(); ++i) {
      const auto& v = p.views[i];
      const auto& val = p.vals[v.val];
      c10::Storage storage = val.dead ? scratch_buffer(val.slot) : val.storage;
      t[i] = at::detail::make_tensor<c10::TensorImpl>(
          std::move(storage),
          c10::DispatchKeySet(c10::DispatchKey::CPU), c10::scalarTypeToTypeMeta(v.dtype));
    }
    std::vector<int64_t> idx(p.bd + 1), sizes;
    for (int64_t b = b0; b < b1; ++b) {
      int64_t t0, t1;
      p.block(b, idx.data(), t0, t1);
      for (size_t i = 0; i < p.views.size(); ++i) {
        const auto& v = p.views[i];
        sizes.resize(v.sizes.size());
        int64_t off = p.narrow(v, idx.data(), t0, t1, sizes.data());
        // A dead value's block sits at the start of its scratch buffer.
        if (p.vals[v.val].dead) off = 0;
        t[i].unsafeGetTensorImpl()->set_sizes_and_strides(sizes, v.strides, off);
      }
      for (size_t k = 0; k < p.steps.size();) {
        if (p.folded[k]) {
          ++k;
          continue;
        }
        if (p.run_at[k] >= 0) {
          run_block(p, p.run_at[k], t, idx.data(), t0, t1);
          k += p.runs[p.run_at[k]].count;
          continue;
        }
        const auto& s = p.steps[k++];
        torch::jit::Stack st;
        st.reserve(s.args.size() + 1);
        for (const auto& a : s.args) {
          if (a.view >= 0) {
            st.emplace_back(t[a.view]);
          } else if (a.list) {
            c10::List<at::Tensor> l;
            for (int v : a.views) l.push_back(t[v]);
            st.emplace_back(std::move(l));
          } else {
            st.push_back(a.constant);
          }
        }
        if (s.use_out) st.emplace_back(t[s.out]);
        s.kernel.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st);
      }
    }
  });
}

}  // namespace

namespace {

// The window's ops as one rows kernel, launched; false (nothing launched) where that could
// not be bit-identical to eager or would save nothing.
bool launch_rows(c10::DeviceIndex d, int64_t stream, std::vector<Op>& ops,
                 const std::vector<std::vector<Ref>>& refs, const std::vector<int64_t>& shape) {
  auto plan = make_row_plan(ops, refs, shape);
  if (!plan || !plan_gains(*plan)) return false;
  plan_exact_runs(*plan, ops, shape);
  fold_cats(*plan);
  // Exact ops whose NaN bits depend on the loop, where ATen computes them on blocks.
  std::vector<bool> in_run(ops.size(), false);
  for (const auto& r : plan->runs) std::fill(in_run.begin() + r.first, in_run.begin() + r.first + r.count, true);
  for (size_t k = 0; k < ops.size(); ++k) {
    if (ops[k].exact && !ops[k].split_free && !in_run[k] && !plan->folded[k] &&
        !loops_match_eager(*plan, ops[k], refs[k])) {
      return false;
    }
  }
  count_fused(int64_t(ops.size()), one_pass_ops(plan->runs));
  // One HBM round trip: what the window reads before writing it, and its live outputs.
  int64_t bytes_in = 0, bytes_out = 0;
  std::vector<bool> written(plan->vals.size(), false);
  std::set<std::pair<int, int64_t>> counted;
  auto nbytes = [](const RowPlan::View& v) {
    return c10::multiply_integers(v.sizes) * int64_t(c10::elementSize(v.dtype));
  };
  for (const auto& s : plan->steps) {
    for (const auto& a : s.args) {
      std::vector<int> vs = a.list ? a.views : std::vector<int>{a.view};
      for (int v : vs) {
        if (v < 0) continue;
        const auto& view = plan->views[v];
        if (written[view.val] || !counted.insert({view.val, view.offset}).second) continue;
        bytes_in += nbytes(view);
      }
    }
    written[plan->views[s.out].val] = true;
    if (!plan->vals[plan->views[s.out].val].dead) bytes_out += nbytes(plan->views[s.out]);
  }
  record_fused(d, ops.front().dtype, plan->numel, int64_t(ops.size()), bytes_in, bytes_out);
  // The kernel holds CPU storages over the device memory; the allocator keeps blocks freed
  // after the launch out of reuse until it has run.
  queue::launch_now(d, stream, "neuron::fused_rows", [plan] { run_rows(*plan); }, bytes_in + bytes_out);
  return true;
}

}  // namespace

void flush_rows(c10::DeviceIndex d, int64_t stream, std::vector<Op>& ops,
                const std::vector<std::vector<Ref>>& refs, const std::vector<int64_t>& shape) {
  if (launch_rows(d, stream, ops, refs, shape)) return;
  // Not as a whole: one op whose loops would not line up with eager's (a transcendental, a
  // narrowing cast) need not cost the ops around it their fusion. The window runs as its
  // longest prefix that fuses (or its first op alone), then the rest likewise, in program
  // order. The ops of a part are moved out of the window while it is planned, so that what
  // only the part refers to counts as dead and what later ops read stays live.
  size_t i = 0, parts = 0;
  while (i < ops.size()) {
    size_t k = ops.size();
    for (; k >= i + 2; --k) {
      if (k == ops.size() && i == 0) continue;  // the whole window: tried above
      std::vector<Op> part;
      for (size_t j = i; j < k; ++j) part.push_back(std::move(ops[j]));
      std::vector<std::vector<Ref>> part_refs(refs.begin() + i, refs.begin() + k);
      const bool ok = launch_rows(d, stream, part, part_refs, shape);
      for (size_t j = i; j < k; ++j) ops[j] = std::move(part[j - i]);
      if (ok) break;
    }
    if (k < i + 2) {  // no part from here fuses: its first op runs alone
      std::vector<Op> one;
      one.push_back(std::move(ops[i]));
      launch_unfused(d, stream, one);
      k = i + 1;
    }
    i = k;
    ++parts;
  }
  g_kernels.fetch_add(int64_t(parts) - 1);  // the window was counted as one kernel
}

}  // namespace neuron::fusion::detail
