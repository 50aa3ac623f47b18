// Adaptive Eager Execution: queued pointwise ops are held in a short per-device window and
// launched as one fused kernel when the window closes (a non-pointwise op, a host read, an
// event, a stream change, a shape change, or 16 ops).
//
// The fused kernel runs the window's ops chunk by chunk: every op of the chain on one
// cache-sized chunk, then the next chunk, so intermediates stay in cache and those the
// program no longer references never reach memory (they go to per-chunk scratch). A window
// with no such intermediate gains nothing from it and runs unfused. Each op
// on a chunk is ATen's own CPU kernel, and the chunks reproduce eager execution's split of
// the element range exactly (the per-thread ranges of at::parallel_for, and within them
// the vector/scalar boundary of ATen's vectorized loops), so every element is computed by
// the same code path as unfused eager: results are identical bit for bit, in every dtype.
// (Inductor's generated kernels, which torch.compile uses, are not: their transcendental
// functions and loop tails differ from ATen's in the last bit.)
#include "neuron.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <pthread.h>

#include <array>
#include <atomic>
#include <cstdlib>
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

struct Window {
  std::mutex mu;
  std::atomic<bool> held{false};  // ops waiting: lets every launch and wait skip the lock
  std::vector<Op> ops;
  int64_t stream = 0;
  std::vector<int64_t> shape;
};

std::array<Window, 64> g_windows;

// A forked child has no executor threads and may have inherited a window mutex held by a
// thread that does not exist there: start over, empty.
bool g_atfork = [] {
  pthread_atfork(nullptr, nullptr, [] {
    for (auto& w : g_windows) {
      new (&w.mu) std::mutex();
      new (&w.ops) std::vector<Op>();
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

Plan make_plan(std::vector<Op>& ops) {
  Plan p;
  p.numel = ops.front().numel;
  // Liveness first: the plan's own copies of the tensors would count as references.
  Refs refs;
  count_refs(ops, refs);
  std::unordered_map<const void*, bool> dead;
  for (auto& op : ops) {
    if (op.use_out) dead[address(op.outs[0])] = only_window_holds(op.outs[0], refs);
  }
  std::unordered_map<const void*, int> by_address;
  auto value_of = [&](const at::Tensor& t) {
    const void* a = address(t);
    auto it = by_address.find(a);
    if (it != by_address.end()) return it->second;
    int idx = int(p.values.size());
    auto d = dead.find(a);
    p.values.push_back({t, d != dead.end() && d->second});
    by_address[a] = idx;
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

void flush_locked(c10::DeviceIndex d, Window& w) {
  if (w.ops.empty()) return;
  std::vector<Op> ops;
  ops.swap(w.ops);
  w.held.store(false, std::memory_order_relaxed);
  g_kernels.fetch_add(1);
  if (ops.size() == 1) {
    Op& op = ops.front();
    record_op(op.name, d, op.dtype, op.shape_tensors, op.bytes_in, op.bytes_out);
    queue::launch_now(d, w.stream, op.name, std::move(op.run));
    return;
  }
  auto plan = std::make_shared<Plan>(make_plan(ops));
  // What fusion saves is memory traffic for intermediates the program has dropped. A chain
  // whose every value stays live (an optimizer's in-place updates) would only pay the
  // chunking's per-call cost: run it unfused.
  bool any_dead = false;
  for (const auto& v : plan->values) any_dead = any_dead || v.dead;
  if (!any_dead) {
    g_kernels.fetch_add(int64_t(ops.size()) - 1);
    for (auto& op : ops) {
      record_op(op.name, d, op.dtype, op.shape_tensors, op.bytes_in, op.bytes_out);
      queue::launch_now(d, w.stream, op.name, std::move(op.run));
    }
    return;
  }
  g_fused_kernels.fetch_add(1);
  g_fused_ops.fetch_add(int64_t(ops.size()));
  // One HBM round trip: inputs read once, live outputs written once.
  int64_t bytes_in = 0, bytes_out = 0;
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
  record_fused(d, ops.front().dtype, plan->numel, int64_t(ops.size()), bytes_in, bytes_out);
  // The kernel needs the device tensors' memory, not the tensors: it keeps CPU views only,
  // and the allocator holds blocks freed after the launch until this work has run. So the
  // device tensors (`hold`, `ops`) are released only once the kernel is queued.
  std::vector<at::Tensor> hold;
  for (auto& v : plan->values) {
    hold.push_back(v.tensor);
    v.tensor = cpu_alias(v.tensor);
  }
  queue::launch_now(d, w.stream, "neuron::fused_pointwise", [plan] {
    auto ranges = eager_ranges(plan->numel);
    if (ranges.size() == 1) {
      run_range(*plan, 0, plan->numel);
      return;
    }
    at::parallel_for(0, int64_t(ranges.size()), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) run_range(*plan, ranges[t].first, ranges[t].second);
    });
  });
  hold.clear();
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

// Two operands over overlapping memory that are not the same tensor would break the
// element-by-element independence chunking relies on.
bool overlaps(const std::vector<Op>& held, const Op& op) {
  auto device_tensor = [](const IValue& v) {
    return v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDevice;
  };
  for (const auto& a : op.args) {
    if (!device_tensor(a)) continue;
    const at::Tensor& x = a.toTensor();
    for (const auto& h : held) {
      for (const auto& b : h.args) {
        if (!device_tensor(b)) continue;
        const at::Tensor& y = b.toTensor();
        if (x.storage().data() == y.storage().data() &&
            (address(x) != address(y) || x.element_size() != y.element_size())) {
          return true;
        }
      }
    }
  }
  return false;
}

}  // namespace

void append(c10::DeviceIndex d, int64_t stream, Op op) {
  g_ops.fetch_add(1, std::memory_order_relaxed);
  Window& w = g_windows[d];
  std::lock_guard<std::mutex> g(w.mu);
  if (!w.ops.empty() &&
      (w.stream != stream || w.shape != op.shape || overlaps(w.ops, op))) {
    flush_locked(d, w);
  }
  if (w.ops.empty()) {
    w.stream = stream;
    w.shape = op.shape;
    w.held.store(true, std::memory_order_relaxed);
  }
  w.ops.push_back(std::move(op));
  if (w.ops.size() >= kMaxWindow) flush_locked(d, w);
}

void flush(c10::DeviceIndex d) {
  Window& w = g_windows[d];
  if (!w.held.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> g(w.mu);
  flush_locked(d, w);
}

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
