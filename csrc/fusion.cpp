// Adaptive Eager Execution: queued ops are held in a short per-device window and launched
// as one fused kernel when the window closes (an op that cannot join, a host read, an
// event, a stream change, or 16 ops).
//
// The fused kernel runs the window's ops block by block: every op of the chain on one
// cache-sized block, then the next block, so intermediates stay in cache and those the
// program no longer references never reach memory (they go to per-block scratch). A window
// with no such intermediate gains nothing from it and runs unfused. Each op on a block is
// ATen's own CPU kernel, and blocks are cut where they cannot change a result, so every
// element is computed by the same code path as unfused eager: results are identical bit for
// bit, in every dtype. (Inductor's generated kernels, which torch.compile uses, are not:
// their transcendental functions and loop tails differ from ATen's in the last bit.)
//
// Two kinds of window:
// - pure: pointwise ops over contiguous operands of one shape. Blocks are ranges of the
//   flat element range, cut to reproduce eager execution's split (the per-thread ranges of
//   at::parallel_for, and within them the vector/scalar boundary of ATen's loops).
// - rows: pointwise ops with broadcast operands, reductions over the last dim and
//   concatenation along it, over tensors that share their leading (row) dims. Blocks are
//   sets of whole rows, so a reduction sees each row whole (ATen reduces a row by itself,
//   whatever the rest of the tensor holds). Ops whose bits depend on the vector/scalar split
//   (transcendentals) are taken only where block cuts fall on eager's own split points.
#include "neuron.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <map>
#include <set>
#include <mutex>
#include <unordered_map>

namespace neuron::fusion {

namespace {

using c10::IValue;

std::atomic<int> g_enabled{-1};  // -1: not yet read from the environment
std::atomic<int64_t> g_ops{0}, g_kernels{0}, g_fused_kernels{0}, g_fused_ops{0};

constexpr size_t kMaxWindow = 16;
// Elements per chunk: a multiple of every vectorized loop's stride (2 vectors of up to 64
// bytes, for 1-byte dtypes 128 elements); large enough that ATen's per-call cost (a few
// microseconds) stays small next to the chunk's work, small enough (1 MiB of fp32) that a
// chain's chunks stay in cache.
constexpr int64_t kChunk = 262144;
constexpr int64_t kGrain = at::internal::GRAIN_SIZE;

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

struct Window {
  std::mutex mu;
  std::atomic<bool> held{false};  // ops waiting: lets every launch and wait skip the lock
  std::vector<Op> ops;
  std::vector<std::vector<Ref>> refs;  // per op
  int64_t stream = 0;
  std::vector<int64_t> shape;  // the first op's iteration shape
  bool rows = false;           // a rows window (else pure, or foreach)
  bool foreach = false;        // a window of `_foreach_` ops
  bool all_row = true;         // every op held could also run row-blocked
};

std::array<Window, 64> g_windows;

// A forked child has no executor threads and may have inherited a window mutex held by a
// thread that does not exist there: start over, empty.
bool g_atfork = [] {
  pthread_atfork(nullptr, nullptr, [] {
    for (auto& w : g_windows) {
      new (&w.mu) std::mutex();
      new (&w.ops) std::vector<Op>();
      new (&w.refs) std::vector<std::vector<Ref>>();
    }
  });
  return true;
}();

const void* address(const at::Tensor& t) {
  return static_cast<const char*>(t.storage().data()) + t.storage_offset() * t.element_size();
}

// Where a value of the chain lives while the fused kernel runs.
struct Value {
  at::Tensor tensor;  // the device tensor (for its memory and dtype)
  bool dead = false;  // nobody outside the window can read it: chunks go to scratch
};

struct Plan {
  struct Arg {
    int value = -1;  // index into values, or -1 for a non-tensor argument
    IValue constant;
  };
  struct Step {
    c10::OperatorHandle kernel;
    bool use_out;
    std::vector<Arg> args;
    int out = -1;  // value written (the out= tensor, or self for an in-place op)
  };
  std::vector<Value> values;
  std::vector<Step> steps;
  int64_t numel = 0;
};

// The window's own references to each TensorImpl: (one of its tensors, count).
using Refs = std::unordered_map<const c10::TensorImpl*, std::pair<const at::Tensor*, int64_t>>;

void count_refs(const std::vector<Op>& ops, Refs& refs) {
  auto add = [&](const at::Tensor& t) {
    auto& r = refs[t.unsafeGetTensorImpl()];
    r.first = &t;
    ++r.second;
  };
  for (const auto& op : ops) {
    for (const auto& v : op.args) {
      if (v.isTensor() && v.toTensor().defined()) add(v.toTensor());
      if (v.isTensorList()) {
        for (const IValue& e : v.toListRef()) add(e.toTensor());
      }
    }
    for (const auto& t : op.outs) add(t);
    for (const auto& t : op.shape_tensors) add(t);
  }
}

// Is every reference to this fresh output (and to its storage) the window's own?
bool only_window_holds(const at::Tensor& t, const Refs& refs) {
  int64_t window_impls = 0;
  for (auto& [impl, r] : refs) {
    if (!impl->has_storage() || r.first->storage().data() != t.storage().data()) continue;
    ++window_impls;
    // A Python tensor object the program dropped lives on while C++ holds the tensor, and
    // holds one reference itself; it is the program's only if Python still refers to it.
    const auto* slot = impl->pyobj_slot();
    int64_t python = slot->load_pyobj() != nullptr && slot->has_unique_reference() ? 1 : 0;
    if (static_cast<int64_t>(r.first->use_count()) - python > r.second) return false;
  }
  return static_cast<int64_t>(t.storage().use_count()) == window_impls;
}

// `refs`: every reference the window holds (counted before the plan copies any).
Plan make_plan(std::vector<Op>& ops, const Refs& refs) {
  Plan p;
  p.numel = ops.front().numel;
  std::unordered_map<const void*, bool> dead;
  for (auto& op : ops) {
    if (op.use_out) dead[address(op.outs[0])] = only_window_holds(op.outs[0], refs);
  }
  std::map<std::pair<const void*, int>, int> by_address;
  auto value_of = [&](const at::Tensor& t) {
    const void* a = address(t);
    auto it = by_address.find({a, int(t.scalar_type())});
    if (it != by_address.end()) return it->second;
    int idx = int(p.values.size());
    auto d = dead.find(a);
    p.values.push_back({t, d != dead.end() && d->second});
    by_address[{a, int(t.scalar_type())}] = idx;
    return idx;
  };
  for (auto& op : ops) {
    Plan::Step s{*op.kernel, op.use_out, {}, -1};
    for (auto& v : op.args) {
      Plan::Arg a;
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDevice) {
        a.value = value_of(v.toTensor());
      } else {
        a.constant = v;
      }
      s.args.push_back(std::move(a));
    }
    s.out = op.use_out ? value_of(op.outs[0]) : s.args[op.self].value;
    p.steps.push_back(std::move(s));
  }
  return p;
}

// What fusion saves is memory traffic: for intermediates the program has dropped (they
// never reach memory), and for values several ops touch (in cache between them, as an
// optimizer's in-place updates). A chain with neither would only pay the chunking's
// per-call cost.
bool plan_gains(const Plan& p) {
  std::vector<int> uses(p.values.size(), 0);
  for (const auto& s : p.steps) {
    std::set<int> touched{s.out};
    for (const auto& a : s.args) {
      if (a.value >= 0) touched.insert(a.value);
    }
    for (int v : touched) ++uses[v];
  }
  for (size_t v = 0; v < uses.size(); ++v) {
    if (p.values[v].dead || uses[v] > 1) return true;
  }
  return false;
}

// Runs the plan over [begin, end), one chunk of every op at a time.
// Chunk buffers for dead values, per thread and kept: fresh ones would be page-faulted in
// (and zeroed by the kernel) on every run.
c10::Storage scratch_buffer(size_t slot) {
  thread_local std::vector<c10::Storage> pool;
  while (pool.size() <= slot) {
    pool.emplace_back(c10::Storage::use_byte_size_t(), kChunk * 8, c10::GetAllocator(c10::kCPU),
                      /*resizable=*/false);
  }
  return pool[slot];
}

void run_range(const Plan& p, int64_t begin, int64_t end) {
  // One CPU view per value, re-pointed at each chunk (nothing keeps them between calls).
  std::vector<at::Tensor> views(p.values.size());
  size_t slots = 0;
  for (size_t i = 0; i < p.values.size(); ++i) {
    if (p.values[i].dead) {
      views[i] = at::detail::make_tensor<c10::TensorImpl>(
          scratch_buffer(slots++), c10::DispatchKeySet(c10::DispatchKey::CPU),
          p.values[i].tensor.dtype());
    } else {
      views[i] = cpu_alias(p.values[i].tensor);
    }
  }
  for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
    int64_t len = std::min(kChunk, end - c0);
    for (size_t i = 0; i < p.values.size(); ++i) {
      int64_t offset = p.values[i].dead ? 0 : p.values[i].tensor.storage_offset() + c0;
      const int64_t size[1] = {len}, stride[1] = {1};
      views[i].unsafeGetTensorImpl()->set_sizes_and_strides(c10::IntArrayRef(size),
                                                             c10::IntArrayRef(stride), offset);
    }
    for (const auto& s : p.steps) {
      torch::jit::Stack st;
      st.reserve(s.args.size() + 1);
      for (const auto& a : s.args) {
        if (a.value >= 0) st.emplace_back(views[a.value]);
        else st.push_back(a.constant);
      }
      if (s.use_out) st.emplace_back(views[s.out]);
      s.kernel.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &st);
    }
  }
}

// Eager's split of [0, n) across threads (at::parallel_for with TensorIterator's grain).
std::vector<std::pair<int64_t, int64_t>> eager_ranges(int64_t n) {
  int64_t threads = at::get_num_threads();
  if (n < kGrain || threads == 1) return {{0, n}};
  int64_t tasks = std::min(threads, (n + kGrain - 1) / kGrain);
  int64_t chunk = (n + tasks - 1) / tasks;
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t b = 0; b < n; b += chunk) out.emplace_back(b, std::min(n, b + chunk));
  return out;
}

// ---- rows windows ----

// Elements of the widest operand per block: the chain's blocks stay in cache, and ATen's
// per-call cost (a few microseconds per op) stays small next to a block's work.
constexpr int64_t kRowBlock = 131072;
// Every vectorized loop's stride (2 vectors of 64 bytes, for 1-byte dtypes 128 elements)
// divides it: a loop started this many elements later lines its vectors up the same way.
constexpr int64_t kAlign = 128;

// The operand's non-broadcast dims as (window dim, size, stride).
std::vector<std::array<int64_t, 3>> placed_dims(const Ref& r) {
  std::vector<std::array<int64_t, 3>> out;
  for (size_t j = 0; j < r.sizes.size(); ++j) {
    if (r.sizes[j] != 1) out.push_back({int64_t(j) + r.shift, r.sizes[j], r.strides[j]});
  }
  return out;
}

// Same elements in the same places (size-1 dims aside): blocking cuts both alike.
bool same_place(const Ref& a, const Ref& b) {
  return a.buf == b.buf && a.dtype == b.dtype && a.offset == b.offset &&
         placed_dims(a) == placed_dims(b);
}

std::vector<Ref> refs_of(const Op& op) {
  const int rank = int(op.shape.size());
  std::vector<Ref> out;
  auto add = [&](const at::Tensor& t, bool write, int shift, int index) {
    // A foreach op's tensors line up index by index, not with its `shape`.
    if (!op.parts.empty()) shift = 0;
    out.push_back({t.storage().data(), t.scalar_type(), t.sizes().vec(), t.strides().vec(),
                   t.storage_offset(), shift, write, index});
  };
  for (size_t i = 0; i < op.args.size(); ++i) {
    const IValue& v = op.args[i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDevice) {
      add(v.toTensor(), int(i) == op.self, rank - int(v.toTensor().dim()), -1);
    } else if (v.isTensorList()) {
      const auto& l = v.toListRef();
      for (size_t k = 0; k < l.size(); ++k) {
        add(l[k].toTensor(), int(i) == op.self, rank - int(l[k].toTensor().dim()),
            op.parts.empty() ? -1 : int(k));
      }
    }
  }
  // A reduction's output lines up with its input's leading dims (keepdim or not).
  if (op.use_out) add(op.outs[0], true, 0, -1);
  if (!op.parts.empty()) {
    for (size_t k = 0; k < op.outs.size(); ++k) add(op.outs[k], true, 0, int(k));
  }
  return out;
}

// A written buffer must be seen in one place only by the whole window: another view of it
// (shifted, transposed, reinterpreted) would read or write across block cuts, and in a
// foreach window another list index would see it out of program order.
bool conflicts(const std::vector<std::vector<Ref>>& held, const std::vector<Ref>& mine) {
  auto clash = [](const Ref& a, const Ref& b) {
    return a.buf == b.buf && (a.write || b.write) && (!same_place(a, b) || a.index != b.index);
  };
  for (size_t i = 0; i < mine.size(); ++i) {
    for (const auto& refs : held) {
      for (const auto& r : refs) {
        if (clash(mine[i], r)) return true;
      }
    }
    for (size_t j = 0; j < i; ++j) {
      if (clash(mine[i], mine[j])) return true;
    }
  }
  return false;
}

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
  int64_t expect = 1;
  for (int64_t j = int64_t(sizes.size()) - 1; j >= 0; --j) {
    if (sizes[j] != 1 && strides[j] != expect) return false;
    expect *= sizes[j];
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
    if (!ops[i].use_out) continue;
    const Ref& out = refs[i].back();
    bool d = only_window_holds(ops[i].outs[0], counts) && contiguous(out.sizes, out.strides);
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

    if (op.exact) {
      p->steps.push_back(std::move(st));
      continue;
    }
    // The vector/scalar split matters: every operand must be contiguous in the iteration
    // shape, eager's per-thread split points must be block cuts, and each cut must lie a
    // multiple of kAlign into eager's range.
    const auto& O = op.shape;
    for (const auto& r : refs[i]) {
      if (r.sizes != O || r.shift != 0 || !contiguous(r.sizes, r.strides)) return nullptr;
    }
    int64_t inner_o = 1;
    for (size_t m = p->bd + 1; m < O.size(); ++m) inner_o *= O[m];
    auto ranges = eager_ranges(op.numel);
    std::vector<int64_t> starts;
    for (const auto& r : ranges) starts.push_back(r.first);
    int64_t cuts_found = 0;
    for (int64_t b = 0; b < p->blocks; ++b) {
      int64_t e = ((b / p->per_outer) * p->rows[p->bd] + (b % p->per_outer) * p->len) * inner_o;
      size_t r = std::upper_bound(starts.begin(), starts.end(), e) - starts.begin() - 1;
      if ((e - starts[r]) % kAlign != 0) return nullptr;
      cuts_found += e == starts[r];
    }
    if (cuts_found != int64_t(starts.size())) return nullptr;
    p->steps.push_back(std::move(st));
  }
  for (const auto& v : p->views) {
    if (p->vals[v.val].dead && p->len * inner[p->bd] * c10::elementSize(v.dtype) > kChunk * 8) {
      return nullptr;
    }
  }
  return p;
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
      for (const auto& s : p.steps) {
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

void launch_unfused(c10::DeviceIndex d, int64_t stream, std::vector<Op>& ops) {
  g_kernels.fetch_add(int64_t(ops.size()) - 1);
  for (auto& op : ops) {
    record_op(op.name, d, op.dtype, op.shape_tensors, op.bytes_in, op.bytes_out);
    queue::launch_now(d, stream, op.name, std::move(op.run));
  }
}

void flush_rows(c10::DeviceIndex d, int64_t stream, std::vector<Op>& ops,
                const std::vector<std::vector<Ref>>& refs, const std::vector<int64_t>& shape) {
  auto plan = make_row_plan(ops, refs, shape);
  bool gains = false;
  if (plan) {
    std::vector<int> uses(plan->vals.size(), 0);
    for (const auto& s : plan->steps) {
      std::set<int> touched;
      for (const auto& a : s.args) {
        if (a.view >= 0) touched.insert(plan->views[a.view].val);
        for (int v : a.views) touched.insert(plan->views[v].val);
      }
      touched.insert(plan->views[s.out].val);
      for (int v : touched) ++uses[v];
    }
    for (size_t v = 0; v < uses.size(); ++v) gains = gains || plan->vals[v].dead || uses[v] > 1;
  }
  if (!gains) return launch_unfused(d, stream, ops);
  g_fused_kernels.fetch_add(1);
  g_fused_ops.fetch_add(int64_t(ops.size()));
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
  queue::launch_now(d, stream, "neuron::fused_rows", [plan] { run_rows(*plan); });
}

void flush_locked(c10::DeviceIndex d, Window& w) {
  if (w.ops.empty()) return;
  std::vector<Op> ops;
  std::vector<std::vector<Ref>> refs;
  ops.swap(w.ops);
  refs.swap(w.refs);
  w.held.store(false, std::memory_order_relaxed);
  g_kernels.fetch_add(1);
  if (ops.size() == 1) {
    Op& op = ops.front();
    record_op(op.name, d, op.dtype, op.shape_tensors, op.bytes_in, op.bytes_out);
    queue::launch_now(d, w.stream, op.name, std::move(op.run));
    return;
  }
  if (w.rows) return flush_rows(d, w.stream, ops, refs, w.shape);
  // Pure windows: one plan; foreach windows: one plan per list index, run in turn.
  Refs counts;
  count_refs(ops, counts);
  std::vector<std::vector<Op>> chains;
  if (w.foreach) {
    for (size_t i = 0; i < ops.front().parts.size(); ++i) {
      std::vector<Op> chain;
      for (auto& op : ops) chain.push_back(std::move(op.parts[i]));
      count_refs(chain, counts);
      chains.push_back(std::move(chain));
    }
  } else {
    chains.push_back(std::move(ops));
  }
  std::vector<std::shared_ptr<Plan>> plans;
  bool gains = false;
  for (auto& chain : chains) {
    plans.push_back(std::make_shared<Plan>(make_plan(chain, counts)));
    gains = gains || plan_gains(*plans.back());
  }
  if (!w.foreach) ops = std::move(chains.front());
  if (!gains) return launch_unfused(d, w.stream, ops);
  g_fused_kernels.fetch_add(1);
  g_fused_ops.fetch_add(int64_t(ops.size()));
  // One HBM round trip: inputs read once, live outputs written once.
  int64_t bytes_in = 0, bytes_out = 0, numel = 0;
  for (const auto& plan : plans) {
    std::vector<bool> written(plan->values.size(), false), read(plan->values.size(), false);
    for (const auto& s : plan->steps) {
      for (const auto& a : s.args) {
        if (a.value >= 0 && !written[a.value] && !read[a.value]) {
          read[a.value] = true;
          bytes_in += plan->values[a.value].tensor.nbytes();
        }
      }
      written[s.out] = true;
    }
    for (size_t i = 0; i < plan->values.size(); ++i) {
      if (written[i] && !plan->values[i].dead) bytes_out += plan->values[i].tensor.nbytes();
    }
    numel += plan->numel;
  }
  record_fused(d, ops.front().dtype, numel, int64_t(ops.size()), bytes_in, bytes_out);
  // The kernel needs the device tensors' memory, not the tensors: it keeps CPU views only,
  // and the allocator holds blocks freed after the launch until this work has run. So the
  // device tensors (`hold`, `ops`) are released only once the kernel is queued.
  std::vector<at::Tensor> hold;
  for (auto& plan : plans) {
    for (auto& v : plan->values) {
      hold.push_back(v.tensor);
      v.tensor = cpu_alias(v.tensor);
    }
  }
  queue::launch_now(d, w.stream, w.foreach ? "neuron::fused_foreach" : "neuron::fused_pointwise",
                    [plans] {
    for (const auto& plan : plans) {
      auto ranges = eager_ranges(plan->numel);
      if (ranges.size() == 1) {
        run_range(*plan, 0, plan->numel);
        continue;
      }
      at::parallel_for(0, int64_t(ranges.size()), 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) run_range(*plan, ranges[t].first, ranges[t].second);
      });
    }
  });
  hold.clear();
  chains.clear();
  ops.clear();
}

}  // namespace

bool enabled() {
  int e = g_enabled.load(std::memory_order_relaxed);
  if (e < 0) {
    const char* v = std::getenv("TORCH_NEURONX_ADAPTIVE_EAGER");
    e = (v && (std::string(v) == "0" || std::string(v) == "false" || std::string(v) == "off")) ? 0 : 1;
    g_enabled.store(e);
  }
  // Deterministic mode asks for eager's kernels as they are; fusion steps aside.
  return e == 1 && !at::globalContext().deterministicAlgorithms();
}

void set_enabled(bool on) {
  if (!on) flush_all();
  g_enabled.store(on ? 1 : 0);
}

void count_launch() {
  g_ops.fetch_add(1, std::memory_order_relaxed);
  g_kernels.fetch_add(1, std::memory_order_relaxed);
}

namespace {

// Do an op's iteration shape's leading dims match the window's rows? (Its last dim is free:
// blocks never cut it.) Per-row ops without the last dim, as reductions return them, too.
bool rows_match(const std::vector<int64_t>& o, const std::vector<int64_t>& s) {
  size_t k = s.size() - 1;
  if (o.size() == s.size()) return std::equal(o.begin(), o.begin() + k, s.begin());
  return o.size() == k && std::equal(o.begin(), o.end(), s.begin());
}

}  // namespace

void append(c10::DeviceIndex d, int64_t stream, Op op) {
  g_ops.fetch_add(1, std::memory_order_relaxed);
  Window& w = g_windows[d];
  std::lock_guard<std::mutex> g(w.mu);
  auto refs = refs_of(op);
  const bool foreach = !op.parts.empty();
  if (!w.ops.empty()) {
    bool same = w.foreach == foreach && op.shape == w.shape;
    bool pure = !w.rows && (op.pure || foreach) && same;
    bool rows = !pure && op.row && w.all_row && w.shape.size() >= 2 && rows_match(op.shape, w.shape);
    if (w.stream != stream || !(pure || rows) || conflicts(w.refs, refs)) {
      flush_locked(d, w);
    } else if (rows) {
      w.rows = true;
    }
  }
  if (w.ops.empty()) {
    // A window starts with an op big enough to be worth blocking; a small row op (a
    // per-row op after its window closed) runs on its own.
    if (!op.pure && !foreach && !(op.row && op.numel >= kGrain)) {
      g_kernels.fetch_add(1, std::memory_order_relaxed);
      record_op(op.name, d, op.dtype, op.shape_tensors, op.bytes_in, op.bytes_out);
      queue::launch_now(d, stream, op.name, std::move(op.run));
      return;
    }
    w.stream = stream;
    w.shape = op.shape;
    w.rows = !op.pure && !foreach;
    w.foreach = foreach;
    w.all_row = true;
    w.held.store(true, std::memory_order_relaxed);
  }
  w.all_row = w.all_row && op.row;
  w.ops.push_back(std::move(op));
  w.refs.push_back(std::move(refs));
  if (w.ops.size() >= kMaxWindow) flush_locked(d, w);
}

void flush(c10::DeviceIndex d) {
  Window& w = g_windows[d];
  if (!w.held.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> g(w.mu);
  flush_locked(d, w);
}

bool holding(c10::DeviceIndex d) { return g_windows[d].held.load(std::memory_order_relaxed); }

void flush_all() {
  for (int d = 0; d < int(g_windows.size()); ++d) flush(static_cast<c10::DeviceIndex>(d));
}

Stats stats(bool reset) {
  Stats s{g_ops.load(), g_kernels.load(), g_fused_kernels.load(), g_fused_ops.load()};
  if (reset) {
    g_ops.store(0);
    g_kernels.store(0);
    g_fused_kernels.store(0);
    g_fused_ops.store(0);
  }
  return s;
}

}  // namespace neuron::fusion
