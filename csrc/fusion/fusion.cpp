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
//   (transcendentals; NaN-sensitive ones, see Op::split_free) are taken only where ATen on
//   each block meets every element in eager's own loop (fused_rows.cpp, loops_match_eager).
#include "fusion_internal.h"

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

namespace detail {

std::atomic<int> g_enabled{-1};  // -1: not yet read from the environment
std::atomic<int64_t> g_ops{0}, g_kernels{0}, g_fused_kernels{0}, g_fused_ops{0}, g_one_pass_ops{0};

void count_fused(int64_t n_ops, int64_t one_pass_ops) {
  g_fused_kernels.fetch_add(1);
  g_fused_ops.fetch_add(n_ops);
  g_one_pass_ops.fetch_add(one_pass_ops);
}

constexpr size_t kMaxWindow = 16;
constexpr int64_t kGrain = at::internal::GRAIN_SIZE;

struct Window {
  std::mutex mu;
  std::atomic<bool> held{false};  // ops waiting: lets every launch and wait skip the lock
  std::vector<Op> ops;
  std::vector<std::vector<Ref>> refs;  // per op
  int64_t stream = 0;
  std::vector<int64_t> shape;  // the first op's iteration shape
  // pure: pointwise ops over one shape; rows: row-blocked (fused_rows.cpp); foreach: chains
  // of `_foreach_` ops, run list index by list index.
  enum class Kind { kPure, kRows, kForeach } kind = Kind::kPure;
  bool all_row = true;         // every op held could also run row-blocked
  // The window's first op is recorded and the rest are the unrecorded ops of a kernel that
  // charges its own time (a residual add before an rms_norm charged as NKI-lib's): they run
  // fused on the host, but only the first op is recorded, as it would be on its own, since
  // on the chip the charged kernel is a launch of its own.
  bool lead = false;
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
  std::vector<std::set<int>> touched;  // per step: the values it reads or writes
  std::vector<ExactRun> runs;
  std::vector<int> run_at;  // per step: the run starting there, or -1
  int64_t numel = 0;
};

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
    if (op.use_out) {
      dead[address(op.outs[0])] = only_window_holds(op.outs[0], refs);
    } else if (op.overwrites) {
      const at::Tensor& t = op.args[op.self].toTensor();
      dead[address(t)] = only_window_holds(t, refs);
    }
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
    p.touched.push_back({s.out});
    for (const auto& a : s.args) {
      if (a.value >= 0) p.touched.back().insert(a.value);
    }
    p.steps.push_back(std::move(s));
  }
  return p;
}

// Stretches of exact fp32 steps run as one pass (every operand is contiguous, of one shape).
// Planned only once the window is known to fuse.
void plan_runs(Plan& p, const std::vector<Op>& ops) {
  std::vector<ExactStepInfo> info(ops.size());
  auto is_float = [&](int v) { return p.values[v].tensor.scalar_type() == c10::kFloat; };
  for (size_t k = 0; k < ops.size(); ++k) {
    const Plan::Step& st = p.steps[k];
    std::vector<int> view;
    std::vector<const IValue*> constant;
    for (const auto& a : st.args) {
      view.push_back(a.value);
      constant.push_back(a.value >= 0 ? nullptr : &a.constant);
    }
    if (ops[k].exact) info[k].op = decode_exact(st.kernel.schema(), view, constant, st.out, is_float);
    // A pure window's operands are contiguous, of one shape: to eager, and to the run, flat.
    const int64_t numel = ops[k].numel;
    if (info[k].op) model_nan_order(*info[k].op, [numel](int) { return EagerNanOrder::Operand{{numel}, {1}}; });
  }
  std::vector<int> identity(p.values.size());
  std::vector<bool> dead_values;
  for (size_t v = 0; v < p.values.size(); ++v) {
    identity[v] = int(v);
    dead_values.push_back(p.values[v].dead);
  }
  p.runs = make_runs(info, identity, p.touched, dead_values);
  p.run_at.assign(p.steps.size(), -1);
  for (size_t r = 0; r < p.runs.size(); ++r) p.run_at[p.runs[r].first] = int(r);
}

bool saves_traffic(const std::vector<std::set<int>>& touched, const std::vector<bool>& dead) {
  std::vector<int> uses(dead.size(), 0);
  for (const auto& values : touched) {
    for (int v : values) ++uses[v];
  }
  for (size_t v = 0; v < dead.size(); ++v) {
    if (dead[v] || uses[v] > 1) return true;
  }
  return false;
}

bool plan_gains(const Plan& p) {
  std::vector<bool> dead;
  for (const auto& v : p.values) dead.push_back(v.dead);
  return saves_traffic(p.touched, dead);
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
    for (size_t k = 0; k < p.steps.size();) {
      if (p.run_at[k] >= 0) {
        const ExactRun& run = p.runs[p.run_at[k]];
        std::vector<ExactPlace> places(run.mem.size());
        for (size_t q = 0; q < run.mem.size(); ++q) {
          places[q].ptr = views[run.mem[q]].data_ptr<float>();
          places[q].col = 1;
        }
        ExactOrigin origin;
        origin.col = c0;
        run_exact(run, places.data(), nullptr, 0, len, origin);
        k += run.count;
        continue;
      }
      const auto& s = p.steps[k++];
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
  int64_t threads = queue::launch_threads();
  if (n < kGrain || threads == 1) return {{0, n}};
  int64_t tasks = std::min(threads, (n + kGrain - 1) / kGrain);
  int64_t chunk = (n + tasks - 1) / tasks;
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t b = 0; b < n; b += chunk) out.emplace_back(b, std::min(n, b + chunk));
  return out;
}

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

void launch_unfused(c10::DeviceIndex d, int64_t stream, std::vector<Op>& ops) {
  g_kernels.fetch_add(int64_t(ops.size()) - 1);
  for (auto& op : ops) {
    record_op(op.name, d, op.dtype, op.shape_tensors, op.bytes_in, op.bytes_out);
    queue::launch_now(d, stream, op.name, std::move(op.run), op.bytes_in + op.bytes_out);
  }
}

// Records follow the window's ops, not the flushing thread (which may be inside or outside
// a charging kernel when the window closes).
struct RecordingAs {
  explicit RecordingAs(bool on) : prev(set_recording(on)) {}
  ~RecordingAs() { set_recording(prev); }
  bool prev;
};

void flush_ops(c10::DeviceIndex d, Window& w, std::vector<Op>& ops,
               std::vector<std::vector<Ref>>& refs);

void flush_locked(c10::DeviceIndex d, Window& w) {
  if (w.ops.empty()) return;
  std::vector<Op> ops;
  std::vector<std::vector<Ref>> refs;
  ops.swap(w.ops);
  refs.swap(w.refs);
  w.held.store(false, std::memory_order_relaxed);
  const bool lead = w.lead;
  w.lead = false;
  if (lead) {
    const Op& op = ops.front();
    RecordingAs on(true);
    record_op(op.name, d, op.dtype, op.shape_tensors, op.bytes_in, op.bytes_out);
  }
  RecordingAs as(ops.front().recorded && !lead);
  flush_ops(d, w, ops, refs);
}

void flush_ops(c10::DeviceIndex d, Window& w, std::vector<Op>& ops,
               std::vector<std::vector<Ref>>& refs) {
  g_kernels.fetch_add(1);
  if (ops.size() == 1) {
    Op& op = ops.front();
    record_op(op.name, d, op.dtype, op.shape_tensors, op.bytes_in, op.bytes_out);
    queue::launch_now(d, w.stream, op.name, std::move(op.run), op.bytes_in + op.bytes_out);
    return;
  }
  if (w.kind == Window::Kind::kRows) return flush_rows(d, w.stream, ops, refs, w.shape);
  const bool foreach = w.kind == Window::Kind::kForeach;
  // Pure windows: one plan; foreach windows: one plan per list index, run in turn.
  Refs counts;
  count_refs(ops, counts);
  std::vector<std::vector<Op>> chains;
  if (foreach) {
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
  if (gains) {
    for (size_t i = 0; i < plans.size(); ++i) plan_runs(*plans[i], chains[i]);
  }
  if (!foreach) ops = std::move(chains.front());
  if (!gains) return launch_unfused(d, w.stream, ops);
  int64_t one_pass = 0;
  for (const auto& plan : plans) one_pass += one_pass_ops(plan->runs);
  count_fused(int64_t(ops.size()), one_pass);
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
  queue::launch_now(d, w.stream, foreach ? "neuron::fused_foreach" : "neuron::fused_pointwise",
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
  }, bytes_in + bytes_out);
  hold.clear();
  chains.clear();
  ops.clear();
}

}  // namespace detail

using namespace detail;

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
  op.recorded = recording();
  using K = Window::Kind;
  const K mine = !op.parts.empty() ? K::kForeach : op.pure ? K::kPure : K::kRows;
  if (!w.ops.empty()) {
    bool same = mine == w.kind && mine != K::kRows && op.shape == w.shape;
    bool rows = !same && op.row && w.all_row && w.shape.size() >= 2 && rows_match(op.shape, w.shape);
    // One recorded op may lead a charging kernel's unrecorded ops; any other change of
    // recording closes the window (its records could not be told apart).
    const bool flips = op.recorded != w.ops.back().recorded;
    const bool leads = flips && !op.recorded && w.ops.size() == 1;
    if (w.stream != stream || !(same || rows) || conflicts(w.refs, refs) || (flips && !leads)) {
      flush_locked(d, w);
    } else {
      if (rows) w.kind = K::kRows;
      if (leads) w.lead = true;
    }
  }
  if (w.ops.empty()) {
    // A window starts with an op big enough to be worth blocking; a small row op (a
    // per-row op after its window closed) runs on its own.
    if (mine == K::kRows && op.numel < kGrain) {
      g_kernels.fetch_add(1, std::memory_order_relaxed);
      record_op(op.name, d, op.dtype, op.shape_tensors, op.bytes_in, op.bytes_out);
      queue::launch_now(d, stream, op.name, std::move(op.run), op.bytes_in + op.bytes_out);
      return;
    }
    w.stream = stream;
    w.shape = op.shape;
    w.kind = mine;
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
  Stats s{g_ops.load(), g_kernels.load(), g_fused_kernels.load(), g_fused_ops.load(),
          g_one_pass_ops.load()};
  if (reset) {
    g_one_pass_ops.store(0);
    g_ops.store(0);
    g_kernels.store(0);
    g_fused_kernels.store(0);
    g_fused_ops.store(0);
  }
  return s;
}

namespace {
// The runtime below closes the window through this hook (it cannot call up into fusion/).
const bool g_closer_registered = (queue::set_window_closer(&flush, &flush_all), true);
}  // namespace

}  // namespace neuron::fusion
