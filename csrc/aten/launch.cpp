// Asynchronous launch of an op: what the host does so that it can return before the kernel
// runs. Like a CUDA launch, the host must know every output's shape, strides and dtype
// before any data exists. It gets them from the op's Meta kernel once per argument
// signature (sizes, strides, dtypes and the non-tensor arguments that can shape a result),
// allocates the outputs, snapshots the arguments as CPU aliases, and queues the CPU kernel.
// An op whose outputs depend on data (nonzero, item), draws random numbers, returns
// non-tensors or has no Meta kernel for these arguments runs synchronously instead.
#include "launch_internal.h"

#include <numeric>

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <array>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace neuron::launch {

using namespace detail;

namespace {

using c10::IValue;

struct OutMeta {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  bool defined;  // e.g. a gradient the output mask did not ask for
};

struct Entry {
  std::vector<int64_t> key;
  bool async = false;
  bool use_out = false;  // the out= overload gave the functional op's results, bit for bit
  std::vector<OutMeta> outs;    // fresh outputs, lists flattened
  std::vector<int> list_len;    // per fresh return: -1 for a tensor, else the list length
  // out= arguments passed empty (composite ops call `foo_out(at::empty({0}), ...)`): the
  // launch gives them their shape and memory, as the kernel's resize would.
  std::vector<std::pair<int, OutMeta>> grow;
};

std::mutex g_mu;
std::unordered_map<const void*, Plan> g_plans;
std::unordered_map<uint64_t, std::vector<std::shared_ptr<const Entry>>> g_entries;
size_t g_entry_count = 0;
constexpr size_t kMaxEntries = 200000;


// Launch-time view of the arguments: the signature key, the device, and whether the op can
// be queued at all.
struct Args {
  c10::SmallVector<int64_t, 64> key;
  c10::DeviceIndex device = -1;
  bool ok = true;
  int64_t bytes_in = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::SmallVector<at::Tensor, 3> first;  // for the cost record

  void tensor(const at::Tensor& t) {
    if (!t.defined()) {
      key.push_back(-7);
      return;
    }
    if (t.device().type() == kDevice) {
      if (t.layout() != c10::kStrided || t._is_zerotensor() || t.is_conj() || t.is_neg()) {
        ok = false;
        return;
      }
      auto d = t.device().index();
      if (device == -1) device = d;
      else if (d != device) ok = false;
      key.push_back(-1);
      key.push_back(int64_t(t.scalar_type()));
      key.push_back(t.dim());
      for (auto s : t.sizes()) key.push_back(s);
      for (auto s : t.strides()) key.push_back(s);
      if (dtype == c10::ScalarType::Undefined) dtype = t.scalar_type();
      bytes_in += t.numel() * t.element_size();
      if (first.size() < 3) first.push_back(t);
    } else if (t.device().is_cpu() && t.dim() == 0 && t.layout() == c10::kStrided) {
      key.push_back(-2);
      key.push_back(int64_t(t.scalar_type()));
      key.push_back(t.unsafeGetTensorImpl()->is_wrapped_number());
    } else {
      ok = false;  // a mixed-device call: the synchronous path reports it
    }
  }

  void value(const IValue& v, bool shape_free_scalars) {
    if (!ok) return;
    if (v.isTensor()) return tensor(v.toTensor());
    if (v.isNone()) return key.push_back(-3);
    if (v.isInt()) {
      key.push_back(-4);
      return key.push_back(v.toInt());
    }
    if (v.isBool()) return key.push_back(v.toBool() ? -5 : -6);
    if (v.isDouble()) {
      key.push_back(-8);
      if (!shape_free_scalars) key.push_back(c10::bit_cast<int64_t>(v.toDouble()));
      return;
    }
    if (v.isScalar()) {  // complex or symbolic
      key.push_back(-9);
      return key.push_back(int64_t(v.toScalar().type()));
    }
    if (v.isDevice()) {
      auto d = v.toDevice();
      if (d.type() == kDevice) {
        auto idx = d.has_index() ? d.index() : current_device();
        if (device == -1) device = idx;
      }
      key.push_back(-10);
      key.push_back(int64_t(d.type()) * 256 + d.index());
      return;
    }
    if (v.isString()) {
      key.push_back(-11);
      return key.push_back(int64_t(std::hash<std::string>()(v.toStringRef())));
    }
    if (v.isIntList()) {
      key.push_back(-12);
      for (auto x : v.toIntList()) key.push_back(x);
      return key.push_back(-13);
    }
    if (v.isDoubleList()) {  // e.g. upsampling scale factors shape the result
      key.push_back(-14);
      for (auto x : v.toDoubleList()) key.push_back(c10::bit_cast<int64_t>(double(x)));
      return key.push_back(-13);
    }
    if (v.isBoolList()) {
      key.push_back(-15);
      for (bool x : v.toBoolList()) key.push_back(x);
      return key.push_back(-13);
    }
    if (v.isList()) {  // tensors, optional tensors, scalars
      key.push_back(-16);
      for (const IValue& e : v.toListRef()) {
        if (e.isTensor()) tensor(e.toTensor());
        else if (e.isNone()) key.push_back(-3);
        else if (e.isDouble() || e.isInt() || e.isComplexDouble()) {
          key.push_back(e.isDouble() ? -8 : e.isInt() ? -4 : -9);
          if (!shape_free_scalars) {
            key.push_back(e.isDouble() ? c10::bit_cast<int64_t>(e.toDouble())
                          : e.isInt()  ? e.toInt()
                                       : 0);
          }
        } else {
          ok = false;
        }
      }
      return key.push_back(-13);
    }
    ok = false;
  }
};

uint64_t hash_key(const c10::SmallVector<int64_t, 64>& k) {
  uint64_t h = 1469598103934665603ull;
  for (auto x : k) h = (h ^ uint64_t(x)) * 1099511628211ull;
  return h;
}

at::Tensor meta_like(const at::Tensor& t) {
  auto opts = at::TensorOptions().dtype(t.scalar_type()).device(c10::kMeta);
  if (t.storage_offset() == 0) return at::empty_strided(t.sizes(), t.strides(), opts);
  int64_t extent = 1;
  for (int64_t i = 0; i < t.dim(); ++i) extent += (t.size(i) - 1) * t.stride(i);
  if (t.numel() == 0) extent = 0;
  return at::empty({t.storage_offset() + extent}, opts).as_strided(t.sizes(), t.strides(),
                                                                   t.storage_offset());
}

// `v` with every tensor replaced by `f(tensor)`, through tensor lists and optional-tensor
// lists; a neuron device argument becomes `device`.
template <class F>
IValue map_tensors(const IValue& v, F&& f, c10::Device device) {
  if (v.isTensor()) return v.toTensor().defined() ? IValue(f(v.toTensor())) : v;
  if (v.isDevice() && v.toDevice().type() == kDevice) return IValue(device);
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    out.reserve(v.toTensorList().size());
    for (const at::Tensor& t : v.toTensorList()) out.push_back(t.defined() ? f(t) : t);
    return out;
  }
  if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
    auto list = v.toList().copy();
    for (size_t k = 0; k < list.size(); ++k) list.set(k, map_tensors(list.get(k), f, device));
    return list;
  }
  return v;
}

IValue to_meta(const IValue& v) {
  return map_tensors(v, [](const at::Tensor& t) {
    return t.device().type() == kDevice ? meta_like(t) : t;
  }, c10::Device(c10::kMeta));
}

// Runs the op's Meta kernel to learn its outputs; nullopt when it can't be queued.
std::optional<Entry> learn(const c10::OperatorHandle& op, const Plan& plan,
                           const torch::jit::Stack& stack, size_t base) {
  const auto& args = op.schema().arguments();
  torch::jit::Stack ms;
  for (size_t i = 0; i < args.size(); ++i) ms.push_back(to_meta(stack[base + i]));
  // The kernel returns its out= arguments; keep the Meta ones to compare after the call.
  torch::jit::Stack metas(ms.begin(), ms.end());
  try {
    c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &ms);
  } catch (const std::exception& e) {
    return std::nullopt;  // no Meta kernel, or bad arguments: the synchronous path reports it
  }
  Entry e;
  for (size_t i = 0; i < args.size(); ++i) {
    bool write = args[i].alias_info() && args[i].alias_info()->isWrite();
    if (!write || !stack[base + i].isTensor() || !stack[base + i].toTensor().defined()) continue;
    const at::Tensor& dev = stack[base + i].toTensor();
    const at::Tensor& meta = metas[i].isTensor() ? metas[i].toTensor() : dev;
    if (dev.sizes() == meta.sizes() && dev.strides() == meta.strides()) continue;
    // Only an empty, memoryless out= argument is grown at launch; any other resize (which
    // keeps data) goes through the synchronous path.
    if (dev.numel() != 0 || dev.storage().nbytes() != 0 || meta.scalar_type() != dev.scalar_type()) {
      return std::nullopt;
    }
    e.grow.emplace_back(int(i), OutMeta{meta.sizes().vec(), meta.strides().vec(), meta.scalar_type(), true});
  }
  const size_t r0 = ms.size() - op.schema().returns().size();
  for (int j : plan.fresh) {
    const IValue& r = ms[r0 + j];
    auto add = [&](const at::Tensor& t) {
      if (!t.defined()) {
        e.outs.push_back({{}, {}, c10::kFloat, false});
        return true;
      }
      if (t.device().type() != c10::kMeta || t.layout() != c10::kStrided) return false;
      e.outs.push_back({t.sizes().vec(), t.strides().vec(), t.scalar_type(), true});
      return true;
    };
    if (r.isTensor()) {
      if (!add(r.toTensor())) return std::nullopt;
      e.list_len.push_back(-1);
    } else if (r.isTensorList()) {
      auto l = r.toTensorList();
      for (const at::Tensor& t : l) {
        if (!add(t)) return std::nullopt;
      }
      e.list_len.push_back(int(l.size()));
    } else {
      return std::nullopt;
    }
  }
  e.async = true;
  return e;
}

// Host-side copy of one argument for the queued kernel: device tensors become CPU aliases
// of their memory as it is now (later metadata changes on the host don't reach the kernel).
IValue to_kernel_arg(const IValue& v) {
  return map_tensors(v, [](const at::Tensor& t) {
    return t.device().type() == kDevice ? cpu_alias(t) : snapshot_cpu_scalar(t);
  }, c10::Device(c10::kCPU));
}

}  // namespace

namespace {

struct Pending {
  std::shared_ptr<Entry> entry;  // outputs as the Meta kernel sees them
  uint64_t hash;
  std::vector<const void*> inputs;  // device buffers of the arguments
  std::vector<IValue> args;         // kept only when the out= overload needs checking
  std::vector<at::Tensor> grown;    // the out= arguments grown by the first run
};

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.strides() != b.strides() || a.scalar_type() != b.scalar_type()) {
    return false;
  }
  auto ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) == 0;
}

// Does the out= overload, given outputs shaped like the functional op's, write exactly what
// the functional op returned? Some out= kernels compute differently (e.g. reductions that
// resize `out` to hold an intermediate): those launches copy the functional results instead.
// Warnings of the trial run below are ours, not the user's: an out= kernel may warn that it
// resized a trial output (mse_loss.out did, once per signature), which then simply fails.
struct DropWarnings final : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

bool out_matches(const c10::OperatorHandle& out_op, std::vector<IValue>& args,
                 const std::vector<at::Tensor>& want) {
  DropWarnings drop;
  c10::WarningUtils::WarningHandlerGuard quiet(&drop);
  torch::jit::Stack s;
  // On copies: an op may write an argument its schema does not mark (native_batch_norm's
  // running statistics), and this second run must not apply that write again. The copies
  // keep the strides (a kernel's loop, and so its bits, can depend on them); an argument
  // whose elements overlap cannot be written and is passed as it is.
  auto copy = [](const at::Tensor& t) {
    if (at::has_internal_overlap(t) == at::MemOverlap::Yes) return t;
    return at::empty_strided(t.sizes(), t.strides(), t.options()).copy_(t);
  };
  for (auto& v : args) s.push_back(map_tensors(to_kernel_arg(v), copy, c10::Device(c10::kCPU)));
  std::vector<at::Tensor> outs;
  std::vector<const void*> bufs;
  for (const auto& w : want) {
    auto t = at::empty_strided(w.sizes(), w.strides(), w.options().device(c10::kCPU));
    outs.push_back(t);
    bufs.push_back(t.storage().data());
    s.emplace_back(t);
  }
  try {
    out_op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &s);
  } catch (const std::exception&) {
    return false;
  }
  for (size_t i = 0; i < want.size(); ++i) {
    // A kernel that moved `out` to a new buffer would leave device memory unwritten.
    if (outs[i].storage().data() != bufs[i] || !same_bits(outs[i], cpu_alias(want[i]))) return false;
  }
  return true;
}

void insert(uint64_t h, std::shared_ptr<const Entry> e) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_entry_count >= kMaxEntries) {
    g_entries.clear();
    g_entry_count = 0;
  }
  g_entries[h].push_back(std::move(e));
  ++g_entry_count;
}

void collect_buffers(const IValue& v, std::vector<const void*>& out) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (t.defined() && t.device().type() == kDevice) out.push_back(t.storage().data());
  } else if (v.isList()) {
    for (const IValue& e : v.toListRef()) collect_buffers(e, out);
  }
}

}  // namespace

// The first call of a signature runs synchronously; its real outputs (the CPU kernel's
// dtypes and strides, which a Meta kernel may not match) become the entry later launches
// allocate from. Outputs that share memory with an input keep the op synchronous.
void refuse(std::shared_ptr<void>& learning) {
  auto p = std::static_pointer_cast<Pending>(learning);
  learning.reset();
  if (!p) return;
  p->entry->async = false;
  insert(p->hash, p->entry);
}

void confirm(std::shared_ptr<void>& learning, const c10::OperatorHandle& op,
             const torch::jit::Stack& stack) {
  auto p = std::static_pointer_cast<Pending>(learning);
  learning.reset();
  if (!p) return;
  const Plan& plan = plan_for(op);
  const size_t r0 = stack.size() - op.schema().returns().size();
  auto& e = *p->entry;
  size_t q = 0;
  bool ok = true;
  auto check = [&](const at::Tensor& t) {
    if (q >= e.outs.size()) return false;
    auto& m = e.outs[q++];
    if (!t.defined()) return !m.defined;
    if (!m.defined || t.device().type() != kDevice || t.layout() != c10::kStrided ||
        t.sizes().vec() != m.sizes || t._is_zerotensor() || t.is_conj() || t.is_neg()) {
      return false;
    }
    const void* buf = t.storage().data();
    if (buf && std::find(p->inputs.begin(), p->inputs.end(), buf) != p->inputs.end()) return false;
    m.strides = t.strides().vec();
    m.dtype = t.scalar_type();
    return true;
  };
  for (int j : plan.fresh) {
    const IValue& r = stack[r0 + j];
    if (r.isTensor()) ok = ok && check(r.toTensor());
    else if (r.isTensorList()) {
      for (const at::Tensor& t : r.toTensorList()) ok = ok && check(t);
    } else {
      ok = false;
    }
  }
  for (size_t k = 0; k < e.grow.size() && ok; ++k) {
    // The CPU kernel's layout for a grown out= argument, as for fresh outputs.
    const at::Tensor& t = p->grown[k];
    ok = t.sizes().vec() == e.grow[k].second.sizes && t.scalar_type() == e.grow[k].second.dtype;
    e.grow[k].second.strides = t.strides().vec();
  }
  e.async = ok && q == e.outs.size();
  if (e.async && plan.out_op && !p->args.empty()) {
    std::vector<at::Tensor> want;
    bool defined = true;
    for (int j : plan.fresh) {
      want.push_back(stack[r0 + j].toTensor());
      defined = defined && want.back().defined();
    }
    e.use_out = defined && out_matches(*plan.out_op, p->args, want);
  }
  insert(p->hash, p->entry);
}

namespace {
// Runs a launched op's CPU kernel on `s` (its arguments, as CPU aliases): into its outputs'
// aliases through the out= overload, or by copying what the functional kernel returned.
void run_kernel(const c10::OperatorHandle& kernel, bool use_out, const std::vector<int>& fresh,
                torch::jit::Stack& s, std::vector<at::Tensor>& out_alias) {
  s.reserve(s.size() + out_alias.size());
  if (use_out) {
    for (auto& t : out_alias) s.emplace_back(t);
    kernel.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &s);
    return;
  }
  kernel.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &s);
  size_t q = 0;
  for (int j : fresh) {
    const IValue& r = s[j];
    if (r.isTensor()) {
      const at::Tensor& t = r.toTensor();
      TORCH_CHECK(t.defined() == out_alias[q].defined(), "neuron: internal error: ", kernel.schema().name(),
                  " returned a different set of outputs than its Meta kernel");
      if (t.defined()) out_alias[q].copy_(t);
      ++q;
    } else {
      for (const at::Tensor& t : r.toTensorList()) out_alias[q++].copy_(t);
    }
  }
}
}  // namespace

bool try_launch(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                std::shared_ptr<void>* learning) {
  const Plan& plan = plan_for(op);
  if (!plan.eligible) return false;
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  if (plan.dropout_arg >= 0) {
    const IValue& p = (*stack)[base + plan.dropout_arg];
    if (!p.isDouble() || p.toDouble() != 0.0) return false;
  }
  if (plan.int_indices_arg >= 0) {
    // A mask's selected count is data: the host must wait for it, as CUDA's index does.
    for (const IValue& e : (*stack)[base + plan.int_indices_arg].toListRef()) {
      // Python's indexing passes a full slice between indices as an undefined tensor.
      if (!e.isTensor() || !e.toTensor().defined()) continue;
      auto t = e.toTensor().scalar_type();
      if (t == c10::kBool || t == c10::kByte || !c10::isIntegralType(t, false)) return false;
    }
  }

  // Decided per op once (the plan), not by a name search on every launch.
  const int64_t flags = plan.cost_flags ? cost_flags(schema, stack->data() + base, n) : -1;
  Args a;
  a.key.push_back(reinterpret_cast<int64_t>(&schema));
  for (size_t i = 0; i < n && a.ok; ++i) a.value((*stack)[base + i], plan.has_tensor_input);
  if (!a.ok) return false;
  if (a.device == -1) a.device = current_device();

  uint64_t h = hash_key(a.key);
  // A direct-mapped per-thread cache in front of the shared table: hot loops hit it lock-free.
  thread_local std::array<std::shared_ptr<const Entry>, 512> recent;
  auto& slot = recent[h & 511];
  std::shared_ptr<const Entry> entry;
  if (slot && slot->key.size() == a.key.size() &&
      std::equal(slot->key.begin(), slot->key.end(), a.key.begin())) {
    entry = slot;
  }
  if (!entry) {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_entries.find(h);
    if (it != g_entries.end()) {
      for (const auto& e : it->second) {
        if (e->key.size() == a.key.size() && std::equal(e->key.begin(), e->key.end(), a.key.begin())) {
          entry = e;
          break;
        }
      }
    }
  }
  if (!entry && plan.no_meta) {
    auto e = std::make_shared<Entry>();
    e->key.assign(a.key.begin(), a.key.end());
    e->async = true;
    insert(h, e);
    entry = std::move(e);
  }
  if (!entry) {
    auto learned = learn(op, plan, *stack, base);
    auto e = std::make_shared<Entry>(learned ? std::move(*learned) : Entry{});
    e->key.assign(a.key.begin(), a.key.end());
    if (learned) {
      auto p = std::make_shared<Pending>();
      p->entry = std::move(e);
      p->hash = h;
      for (size_t i = 0; i < n; ++i) collect_buffers((*stack)[base + i], p->inputs);
      for (const auto& [i, m] : p->entry->grow) p->grown.push_back((*stack)[base + i].toTensor());
      bool writes = false;
      for (const auto& arg : schema.arguments()) writes = writes || (arg.alias_info() && arg.alias_info()->isWrite());
      if (plan.out_op && !writes) p->args.assign(stack->begin() + base, stack->end());
      *learning = std::move(p);
      return false;
    }
    insert(h, e);
    entry = std::move(e);
  }
  slot = entry;
  if (!entry->async) return false;
  const auto& outs = entry->outs;
  const auto& list_len = entry->list_len;
  for (const auto& [i, m] : entry->grow) {
    const at::Tensor& t = (*stack)[base + i].toTensor();
    if (t.numel() != 0 || t.storage().nbytes() != 0) return false;
  }
  for (const auto& [i, m] : entry->grow) {
    // A memoryless tensor: no queued work can be using it, so no need to wait.
    const at::Tensor& t = (*stack)[base + i].toTensor();
    auto* impl = t.unsafeGetTensorImpl();
    impl->set_sizes_and_strides(m.sizes, m.strides);
    size_t bytes = at::detail::computeStorageNbytes(m.sizes, m.strides, t.element_size());
    auto* st = t.storage().unsafeGetStorageImpl();
    st->set_data_ptr_noswap(allocate_on(bytes, a.device));
    st->set_nbytes(bytes);
  }

  // Outputs, allocated now as a CUDA launch does.
  std::vector<at::Tensor> out_dev;
  out_dev.reserve(outs.size());
  {
    c10::DeviceIndex prev = current_device();
    if (prev != a.device) set_current_device(a.device);
    for (const auto& m : outs) {
      out_dev.push_back(m.defined ? at::detail::empty_strided_generic(
                                        m.sizes, m.strides, allocator(),
                                        c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), m.dtype)
                                  : at::Tensor());
    }
    if (prev != a.device) set_current_device(prev);
  }

  std::vector<at::Tensor> out_alias;
  out_alias.reserve(out_dev.size());
  int64_t bytes_out = 0;
  bool all_defined = true;
  for (const auto& t : out_dev) {
    if (!t.defined()) {
      all_defined = false;
      out_alias.emplace_back();
      continue;
    }
    out_alias.push_back(cpu_alias(t));
    bytes_out += t.numel() * t.element_size();
  }

  // Results for the caller: written arguments come back as passed, fresh ones are the
  // outputs just allocated.
  const auto& rets = schema.returns();
  std::vector<IValue> results;
  results.reserve(rets.size());
  size_t k = 0, f = 0;
  for (size_t j = 0; j < rets.size(); ++j) {
    if (plan.ret_arg[j] >= 0) {
      results.push_back((*stack)[base + plan.ret_arg[j]]);
      if (results.back().isTensor()) bytes_out += results.back().toTensor().numel() * results.back().toTensor().element_size();
      continue;
    }
    int len = list_len[f++];
    if (len < 0) {
      results.emplace_back(out_dev[k++]);
    } else {
      c10::List<at::Tensor> l;
      for (int q = 0; q < len; ++q) l.push_back(out_dev[k++]);
      results.emplace_back(std::move(l));
    }
  }

  c10::ScalarType dtype = a.dtype != c10::ScalarType::Undefined ? a.dtype
                          : outs.empty() ? c10::kFloat : outs[0].dtype;
  warn_if_unportable(op, dtype);

  std::optional<c10::OperatorHandle> kernel = plan.out_op;
  bool use_out = entry->use_out && kernel.has_value() && !out_alias.empty() && all_defined;
  if (!use_out) kernel = op;
  // The work holds aliases, not the device tensors: the host may free them at once, and
  // the allocator keeps their blocks out of reuse until this work has run.
  auto make_run = [&] {
    std::vector<IValue> kargs;
    kargs.reserve(n);
    for (size_t i = 0; i < n; ++i) kargs.push_back(to_kernel_arg((*stack)[base + i]));
    return [kernel = *kernel, use_out, fresh = &plan.fresh, kargs = std::move(kargs),
            out_alias = std::move(out_alias)]() mutable {
      // Copied, not moved: what the host allocated is freed by the host (see queue.cpp).
      torch::jit::Stack s(kargs.begin(), kargs.end());
      run_kernel(kernel, use_out, *fresh, s, out_alias);
    };
  };

  // Adaptive Eager Execution: a pointwise op over contiguous operands of one shape joins the
  // device's fusion window instead of being queued on its own.
  // Reductions and concatenations along the last dim join it too, with broadcasting
  // pointwise ops (row-blocked: see fusion.cpp).
  // A `_foreach_` op joins as its per-index ops.
  bool pure = false, row = false;
  std::vector<int64_t> iter;
  std::vector<fusion::Op> parts;
  if ((plan.pointwise || plan.row_kind != Plan::kNone) && fusion::enabled()) {
    if (plan.row_kind == Plan::kForeach) {
      parts = foreach_parts(plan, *stack, base, n, out_dev);
    } else {
      pure = plan.pointwise && fusible(plan, *stack, base, n, out_dev, use_out);
      row = row_fusible(plan, *stack, base, n, out_dev, use_out, fusion::holding(a.device), iter);
    }
  }
  if (pure || row || !parts.empty()) {
    fusion::Op f;
    f.pure = pure;
    f.row = row;
    // Reductions and concatenations see whole rows, as eager does: no loop decides a bit.
    NanLoop nan = NanLoop::kFree;
    f.exact = plan.row_kind != Plan::kNone || exact_op(schema, *stack, base, nan);
    f.split_free = plan.row_kind != Plan::kNone ||
                   (f.exact && split_free(nan, schema, written(plan, *stack, base, out_dev).scalar_type()));
    f.kernel = use_out ? *plan.out_op : op;
    f.use_out = use_out;
    f.self = plan.inplace_self;
    if (!parts.empty()) {
      f.self = plan.fresh.empty() ? 0 : -1;
      // A window of `_foreach_` ops needs each index's element count to agree across ops.
      for (const auto& q : parts) iter.push_back(q.numel);
    }
    f.args.assign(stack->begin() + base, stack->end());
    for (auto& v : f.args) {
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().is_cpu()) {
        v = snapshot_cpu_scalar(v.toTensor());
      }
    }
    f.outs = out_dev;
    if (pure) iter = written(plan, *stack, base, out_dev).sizes().vec();
    f.numel = parts.empty() ? c10::multiply_integers(iter) : std::accumulate(iter.begin(), iter.end(), int64_t(0));
    f.shape = std::move(iter);
    f.parts = std::move(parts);
    f.name = schema.operator_name().name.c_str();
    f.dtype = dtype;
    f.shape_tensors.assign(a.first.begin(), a.first.end());
    f.bytes_in = a.bytes_in;
    f.bytes_out = bytes_out;
    f.run = make_run();
    stack->erase(stack->begin() + base, stack->end());
    for (auto& r : results) stack->push_back(std::move(r));
    fusion::append(a.device, current_stream_id(a.device), std::move(f));
    return true;
  }
  record_op(schema.operator_name().name.c_str(), a.device, dtype, a.first, a.bytes_in, bytes_out,
            flags);
  fusion::count_launch();
  const char* name = schema.operator_name().name.c_str();
  const int64_t stream_id = current_stream_id(a.device);
  // Even work smaller than the hand-over runs on the executor: on the calling thread, a
  // kernel with a parallel loop (a GEMM, a convolution, a softmax) would start a second
  // OpenMP team there, and with two teams alive libgomp makes every team's waits sleep
  // (docs/device.md).
  std::function<void()> run = make_run();
  stack->erase(stack->begin() + base, stack->end());
  for (auto& r : results) stack->push_back(std::move(r));
  queue::launch(a.device, stream_id, name, std::move(run), a.bytes_in + bytes_out,
                queue::launch_threads(a.bytes_in));
  return true;
}

}  // namespace neuron::launch
