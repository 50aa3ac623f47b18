// The boxed fallback: every op without a neuron kernel runs its CPU kernel on zero-copy
// aliases of device memory (or is queued by the launch path), and its outputs are adopted as
// device memory. Also routes ops that have both a CPU kernel and a composite to the CPU one.
#include "aten.h"

#include <algorithm>
#include <bitset>
#include <unordered_set>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseCsrTensorUtils.h>
#include <ATen/native/SparseTensorUtils.h>
#include <ATen/SparseTensorImpl.h>
#include <ATen/NestedTensorImpl.h>
#include <ATen/ops/_sparse_compressed_tensor_unsafe.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_and_tensors_native.h>
#include <ATen/ops/_sparse_coo_tensor_with_dims_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <mutex>
#include <set>
#include <unordered_map>

namespace neuron {
namespace {

bool is_compressed(const at::Tensor& t) {
  auto l = t.layout();
  return l == c10::kSparseCsr || l == c10::kSparseCsc || l == c10::kSparseBsr ||
         l == c10::kSparseBsc;
}

// Sparse tensors are dense member tensors plus metadata: rebuild them around the members'
// aliases (to the host) or adopted outputs (to the device).
template <typename F>
at::Tensor rebuild_sparse(const at::Tensor& t, c10::Device device, F&& member) {
  auto opts = t.options().device(device);
  if (t.layout() == c10::kSparse) {
    auto* impl = at::sparse::get_sparse_impl(t);
    return at::_sparse_coo_tensor_with_dims_and_tensors(
        impl->sparse_dim(), impl->dense_dim(), t.sizes(), member(impl->indices()),
        member(impl->values()), opts, impl->coalesced());
  }
  auto* impl = at::sparse_csr::get_sparse_csr_impl(t);
  return at::_sparse_compressed_tensor_unsafe(member(impl->compressed_indices()),
                                              member(impl->plain_indices()),
                                              member(impl->values()), t.sizes(), opts);
}

struct Context;
// Host alias storage -> the device storage it stands for.
using StorageMap = c10::SmallVector<std::pair<const c10::StorageImpl*, c10::Storage>, 8>;
// An in-place sparse kernel may have replaced the members of the host alias.
void sync_sparse(const at::Tensor& dev, const at::Tensor& host, Context& ctx, StorageMap& fresh);

bool is_device_tensor(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDevice;
}

bool is_generator_arg(const c10::Argument& a) {
  auto opt = a.type()->castRaw<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

// A generator's whole state: CPU's Mersenne Twister plus its cached normal samples.
void copy_generator_state(const at::Generator& from, const at::Generator& to) {
  auto* src = from.get<at::CPUGeneratorImpl>();
  auto* dst = to.get<at::CPUGeneratorImpl>();
  dst->set_engine(src->engine());
  dst->set_next_float_normal_sample(src->next_float_normal_sample());
  dst->set_next_double_normal_sample(src->next_double_normal_sample());
}

struct Context {
  c10::DeviceIndex device = -1;
  std::string cpu_arg;          // name of a CPU tensor argument, for the mixed-device error
  c10::DeviceIndex other = -1;  // a second neuron device, for the mixed-device error
  Signature sig;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t bytes_in = 0;
  // Inputs' alias storages, so outputs that alias an input map back to device memory.
  StorageMap storages;
  c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 4> mutated;  // (device, alias)

  // Sparse and nested host aliases carry their own dispatch keys (SparseCPU, SparseCsrCPU,
  // NestedTensorCPU): the kernel is called boxed rather than redispatched to CPU.
  bool own_keys = false;
  std::vector<const void*> reads, writes;  // for the stream checker

  at::Tensor to_host(const at::Tensor& t, bool mutable_arg) {
    auto d = t.device().index();
    if (device == -1) device = d;
    else if (d != device) other = d;
    if (t.is_nested()) {
      // A CPU nested tensor over the host alias of the buffer (the metadata is on the host
      // already); it carries its own keys, as sparse aliases do. In-place nested kernels
      // write the buffer through the alias and never resize it.
      own_keys = true;
      const auto* impl = at::native::get_nested_tensor_impl(t);
      return at::detail::make_tensor<at::native::NestedTensorImpl>(
          to_host(impl->get_unsafe_storage_as_tensor(), mutable_arg), impl->get_nested_sizes(),
          impl->get_nested_strides(), impl->get_storage_offsets());
    }
    if (t.layout() != c10::kStrided) {
      own_keys = true;
      at::Tensor a = rebuild_sparse(t, c10::Device(c10::kCPU),
                                    [this](const at::Tensor& m) { return to_host(m, false); });
      if (mutable_arg) mutated.emplace_back(t, a);
      return a;
    }
    at::Tensor a = cpu_alias(t);
    if (check::enabled()) (mutable_arg ? writes : reads).push_back(t.storage().data());
    storages.emplace_back(a.storage().unsafeGetStorageImpl(), t.storage());
    if (mutable_arg) mutated.emplace_back(t, a);
    if (dtype == c10::ScalarType::Undefined) dtype = t.scalar_type();
    sig.add(t);
    bytes_in += nbytes(t);
    return a;
  }
};

// An `out=` kernel may have resized its output: give the device tensor the new shape, and
// take over the kernel's new buffer if it had to grow.
void sync_resized(const at::Tensor& dev, const at::Tensor& host, Context& ctx, StorageMap& fresh) {
  if (dev.layout() != c10::kStrided) return sync_sparse(dev, host, ctx, fresh);
  auto* impl = dev.unsafeGetTensorImpl();
  if (host.storage().data() != dev.storage().data()) {
    auto* st = dev.storage().unsafeGetStorageImpl();
    size_t n = host.storage().nbytes();
    st->set_data_ptr_noswap(adopt(host.storage(), ctx.device));
    st->set_nbytes(n);
  }
  if (host.sizes() != dev.sizes() || host.strides() != dev.strides() ||
      host.storage_offset() != dev.storage_offset()) {
    impl->set_sizes_and_strides(host.sizes(), host.strides(), host.storage_offset());
  }
}

at::Tensor to_device(const at::Tensor& t, Context& ctx, StorageMap& fresh) {
  if (!t.defined() || t.device().type() != c10::kCPU) return t;
  if (t.is_nested()) {
    // A nested result (the Transformer fast path's _nested_tensor_from_mask): its buffer
    // becomes device memory, its metadata (sizes, strides, offsets) stays on the host as CPU's.
    const auto* impl = at::native::get_nested_tensor_impl(t);
    auto buffer = to_device(impl->get_unsafe_storage_as_tensor(), ctx, fresh);
    return at::detail::make_tensor<at::native::NestedTensorImpl>(
        buffer, impl->get_nested_sizes(), impl->get_nested_strides(), impl->get_storage_offsets());
  }
  if (t.layout() != c10::kStrided) {
    TORCH_CHECK(t.layout() == c10::kSparse || is_compressed(t), "neuron: a kernel produced a ",
                t.layout(), " tensor, a layout the neuron device does not support");
    return rebuild_sparse(t, c10::Device(kDevice, ctx.device),
                          [&](const at::Tensor& m) { return to_device(m, ctx, fresh); });
  }
  const auto* key = t.storage().unsafeGetStorageImpl();
  for (auto& [k, st] : ctx.storages) {
    if (k == key) return wrap_storage(st, t);
  }
  for (auto& [k, st] : fresh) {
    if (k == key) return wrap_storage(st, t);
  }
  auto out = adopt_tensor(t, ctx.device);
  fresh.emplace_back(key, out.storage());
  return out;
}

void sync_sparse(const at::Tensor& dev, const at::Tensor& host, Context& ctx, StorageMap& fresh) {
  // Members the kernel kept are aliases of the device members: to_device maps them back
  // through ctx; new members are adopted.
  auto back = [&](const at::Tensor& m) { return to_device(m, ctx, fresh); };
  if (dev.layout() == c10::kSparse) {
    auto* h = at::sparse::get_sparse_impl(host);
    auto* impl = at::sparse::get_sparse_impl(dev);
    impl->resize_(h->sparse_dim(), h->dense_dim(), host.sizes());
    impl->set_indices_and_values_unsafe(back(h->indices()), back(h->values()));
    impl->set_coalesced(h->coalesced());
  } else {
    auto* h = at::sparse_csr::get_sparse_csr_impl(host);
    auto* impl = at::sparse_csr::get_sparse_csr_impl(dev);
    impl->set_member_tensors(back(h->compressed_indices()), back(h->plain_indices()),
                             back(h->values()), host.sizes());
  }
}

// True when the dtype policy computed the results (CPU had no kernel for the dtypes).
bool run_now(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Ops that had to wait for the device although asynchronous launch was on, by name: what
// `torch_neuronx.queue_stats()` reports to explain lost overlap.
std::mutex g_sync_mu;
std::unordered_map<const char*, int64_t> g_sync_ops;
void count_sync(const char* name) {
  std::lock_guard<std::mutex> g(g_sync_mu);
  ++g_sync_ops[name];
}

DtypeRetry g_dtype_ahead = nullptr;
bool ahead_op(const void* schema);

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& rets = schema.returns();
  const size_t n = schema.arguments().size();

  // View ops: CPU's kernel only rewrites metadata and keeps the input's storage and keys.
  for (const auto& r : rets) {
    if (r.alias_info() && !r.alias_info()->isWrite()) {
      auto key = c10::DispatchKey::CPU;
      for (size_t i = stack->size() - n; i < stack->size(); ++i) {
        const auto& v = (*stack)[i];
        if (v.isTensor() && v.toTensor().defined() && v.toTensor().layout() != c10::kStrided) {
          key = v.toTensor().layout() == c10::kSparse ? c10::DispatchKey::SparseCPU
                                                      : c10::DispatchKey::SparseCsrCPU;
        }
      }
      op.redispatchBoxed(c10::DispatchKeySet(key), stack);
      return;
    }
  }
  // Stochastic rounding on: ops producing bf16/fp16 compute in fp32 and round in Python.
  if (sr::active() && !op.hasTag(at::Tag::inplace_view) && sr::wants(op, *stack) &&
      sr::handle_op(op, stack)) {
    return;
  }
  // In-place view ops (t_, squeeze_) change metadata only: no need to wait for the device.
  std::shared_ptr<void> learning;
  if (!op.hasTag(at::Tag::inplace_view)) {
    if (queue::asynchronous() && !check::enabled()) {
      if (launch::try_launch(op, stack, &learning)) return;
      if (g_dtype_ahead && ahead_op(&schema) && g_dtype_ahead(op, stack)) {
        if (learning) launch::refuse(learning);  // as after a policy's synchronous run
        return;
      }
      if (!learning) count_sync(schema.operator_name().name.c_str());
    }
    queue::synchronize_all();
  }
  const bool by_policy = run_now(op, stack);
  // The CPU kernel would fail again on a launch queue: the policy's ops run now, always.
  if (learning) by_policy ? launch::refuse(learning) : launch::confirm(learning, op, *stack);
}

DtypeRetry g_dtype_retry = nullptr;
// The schemas of the ops the policy covers, each with the argument dtypes (a bit per
// ScalarType) it takes: only then are the arguments kept for it, since a throwing CPU kernel
// may already have moved some (int lists) off the stack. The mask keeps hot ops (add, exp)
// from copying their arguments on every synchronous run for a uint16 or complex32 rule.
std::unordered_map<const void*, uint64_t> g_policy_ops;
std::unordered_set<const void*> g_ahead_ops;  // of those, the ones the policy is asked first
// A one-load filter in front of the map: its hash lookup alone cost ~0.1 us per op in the
// tiny-op benchmark, and almost no op is a policy op.
std::bitset<4096> g_policy_filter;
size_t policy_slot(const void* p) { return (reinterpret_cast<uintptr_t>(p) >> 4) & 4095; }
uint64_t policy_dtypes(const void* schema) {
  if (!g_policy_filter.test(policy_slot(schema))) return 0;
  auto it = g_policy_ops.find(schema);
  return it == g_policy_ops.end() ? 0 : it->second;
}
bool ahead_op(const void* schema) {
  return policy_dtypes(schema) != 0 && g_ahead_ops.count(schema) > 0;
}
bool has_dtype(const c10::IValue& v, uint64_t mask) {
  auto in = [mask](const at::Tensor& t) {
    return t.defined() && ((mask >> static_cast<int>(t.scalar_type())) & 1);
  };
  if (v.isTensor()) return in(v.toTensor());
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor() && in(e.toTensor())) return true;
    }
  }
  return false;
}
// Whether the policy could take these arguments (`args`, the top `n` of the stack).
bool policy_takes(const void* schema, const c10::IValue* args, size_t n) {
  const uint64_t mask = policy_dtypes(schema);
  if (mask == 0) return false;
  for (size_t i = 0; i < n; ++i) {
    if (has_dtype(args[i], mask)) return true;
  }
  return false;
}

bool run_now(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const auto& rets = schema.returns();
  const size_t n = args.size();
  const size_t base = stack->size() - n;
  Context ctx;
  const int64_t flags = cost_flags(schema, stack->data() + base, n);
  c10::SmallVector<std::pair<size_t, c10::IValue>, 2> originals;  // mutable args as passed
  int gen_slot = -1;
  at::Generator gen_dev;
  c10::optional<c10::Device> other_generator;  // a generator not of the device
  int64_t bytes_in = 0;  // the device memory read, as the launch path counts it

  for (size_t i = 0; i < n; ++i) {
    c10::IValue& iv = (*stack)[base + i];
    const auto* alias = args[i].alias_info();
    bool mut = alias && alias->isWrite();
    if (iv.isTensor()) {
      const at::Tensor& t = iv.toTensor();
      if (!t.defined()) continue;
      if (t.device().type() == kDevice) {
        bytes_in += t.numel() * t.element_size();
        if (mut) originals.emplace_back(i, iv);
        iv = ctx.to_host(t, mut);
      } else if (t.device().is_cpu() && t.dim() > 0 && ctx.cpu_arg.empty() &&
                 !(args[i].name() == "scalars" && schema.name().rfind("aten::_foreach_", 0) == 0) &&
                 args[i].name() != "cpu_nested_shape_example") {
        // (A `_foreach_` op's per-tensor `scalars` live on the CPU, as on CUDA, and so does
        // `_nested_from_padded`'s shape example.)
        ctx.cpu_arg = args[i].name();
      }
    } else if (iv.isList()) {
      auto list = iv.toList();
      bool any = false;
      for (size_t k = 0; k < list.size(); ++k) {
        if (is_device_tensor(list.get(k))) { any = true; break; }
      }
      // A host tensor among device tensors is refused as CUDA refuses it (torch.cat), except
      // index lists (a device tensor indexed by host indices, as on CUDA) and _foreach_
      // scalars. A 0-d host tensor passes, as a single one does.
      if (ctx.cpu_arg.empty() && args[i].name() != "indices" &&
          !(args[i].name() == "scalars" && schema.name().rfind("aten::_foreach_", 0) == 0)) {
        for (size_t k = 0; k < list.size(); ++k) {
          const c10::IValue e = list.get(k);
          if (e.isTensor() && e.toTensor().defined() && e.toTensor().device().is_cpu() &&
              e.toTensor().dim() > 0) {
            ctx.cpu_arg = args[i].name();
            break;
          }
        }
      }
      if (!any) continue;
      if (mut) originals.emplace_back(i, iv);
      auto copy = list.copy();
      for (size_t k = 0; k < copy.size(); ++k) {
        c10::IValue e = copy.get(k);
        if (!is_device_tensor(e)) continue;
        bytes_in += e.toTensor().numel() * e.toTensor().element_size();
        copy.set(k, ctx.to_host(e.toTensor(), mut));
      }
      iv = std::move(copy);
    } else if (iv.isDevice()) {
      auto d = iv.toDevice();
      if (d.type() == kDevice) {
        auto idx = resolve_device(d);
        if (ctx.device == -1) ctx.device = idx;
        iv = c10::Device(c10::kCPU);
      }
    } else if (iv.isGenerator()) {
      auto g = iv.toGenerator();
      if (g.device().type() == kDevice) {
        gen_slot = static_cast<int>(i);
        gen_dev = g;
      } else {
        other_generator = g.device();
      }
    } else if (iv.isNone() && is_generator_arg(args[i])) {
      gen_slot = static_cast<int>(i);
    }
  }

  if (ctx.other != -1) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                "devices, neuron:", int(ctx.device), " and neuron:", int(ctx.other),
                "! (when checking arguments of ", schema.operator_name(), ")");
  }
  if (!ctx.cpu_arg.empty() && ctx.device != -1) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                "devices, neuron:", int(ctx.device), " and cpu! (when checking argument '",
                ctx.cpu_arg, "' of ", schema.operator_name(), ")");
  }
  // As CUDA's check_generator, a device op takes only the device's generators. The converse
  // is AWS's: a neuron generator drives a host op (its key set routes the op here) and
  // advances, as diffusers' randn_tensor expects when it draws neuron latents on the CPU.
  TORCH_CHECK(!other_generator, "Expected a 'neuron' device type for generator but found '",
              other_generator ? c10::DeviceTypeName(other_generator->type(), true) : "", "' (",
              schema.operator_name(), ")");
  if (ctx.device == -1) ctx.device = current_device();

  // Random ops draw from the device's generator through a CPU generator carrying its state.
  std::unique_lock<std::mutex> gen_lock;
  at::Generator gen_host;
  if (gen_slot >= 0) {
    if (!gen_dev.defined()) gen_dev = default_generator(ctx.device);
    gen_lock = std::unique_lock<std::mutex>(gen_dev.mutex());
    gen_host = at::make_generator<at::CPUGeneratorImpl>();
    copy_generator_state(gen_dev, gen_host);
    (*stack)[base + gen_slot] = c10::IValue(gen_host);
  }

  queue::HostThreads threads(bytes_in);  // the count it would have run with, queued
  bool by_policy = false;
  std::vector<c10::IValue> kept;
  if (g_dtype_retry && policy_takes(&schema, stack->data() + base, n)) {
    kept.assign(stack->end() - n, stack->end());
  }
  auto retry = [&] {
    if (kept.empty()) return false;
    stack->resize(base);
    stack->insert(stack->end(), kept.begin(), kept.end());
    return g_dtype_retry(op, stack);
  };
  try {
    if (ctx.own_keys) {
      c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
      op.callBoxed(stack);
    } else {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    }
  } catch (c10::NotImplementedError& e) {
    by_policy = retry();
    if (!by_policy) {
      TORCH_CHECK_NOT_IMPLEMENTED(false, "The operator '", schema.operator_name(),
                                  "' is not available on the neuron device: the virtual "
                                  "NeuronCore runs CPU kernels and CPU has none for these "
                                  "arguments. ", e.what_without_backtrace());
    }
  } catch (c10::Error&) {
    // Some CPU kernels refuse a dtype with a plain check (MKL's FFT, complex nansum).
    by_policy = retry();
    if (!by_policy) throw;
  }

  if (gen_slot >= 0) {
    copy_generator_state(gen_host, gen_dev);
    gen_lock.unlock();
  }

  StorageMap fresh;
  for (auto& [dev, host] : ctx.mutated) sync_resized(dev, host, ctx, fresh);

  const size_t r0 = stack->size() - rets.size();
  int64_t bytes_out = 0;
  c10::ScalarType out_dtype = c10::ScalarType::Undefined;
  for (size_t j = 0; j < rets.size(); ++j) {
    c10::IValue& iv = (*stack)[r0 + j];
    const auto* alias = rets[j].alias_info();
    if (alias && alias->isWrite()) {
      for (auto& [i, orig] : originals) {
        if (args[i].alias_info()->beforeSets() == alias->beforeSets()) {
          iv = orig;
          break;
        }
      }
      if (iv.isTensor()) bytes_out += nbytes(iv.toTensor());
      continue;
    }
    if (iv.isTensor()) {
      const auto& t = iv.toTensor();
      if (t.defined() && out_dtype == c10::ScalarType::Undefined) out_dtype = t.scalar_type();
      bytes_out += nbytes(t);
      iv = to_device(t, ctx, fresh);
    } else if (iv.isTensorList()) {
      auto list = iv.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(list.size());
      for (size_t k = 0; k < list.size(); ++k) {
        at::Tensor t = list.get(k);
        bytes_out += nbytes(t);
        out.push_back(to_device(t, ctx, fresh));
      }
      iv = std::move(out);
    }
  }

  if (check::enabled()) {
    for (size_t j = 0; j < rets.size(); ++j) {
      const c10::IValue& iv = (*stack)[r0 + j];
      if (iv.isTensor() && iv.toTensor().defined() && iv.toTensor().device().type() == kDevice &&
          iv.toTensor().layout() == c10::kStrided) {
        ctx.writes.push_back(iv.toTensor().storage().data());
      }
    }
    const char* name = schema.operator_name().name.c_str();
    check::on_op(name, ctx.device, ctx.reads, ctx.writes);
    if (schema.operator_name().name == "aten::_local_scalar_dense") {
      check::on_stream_sync(ctx.device, current_stream_id(ctx.device));
    }
  }
  c10::ScalarType dtype = ctx.dtype != c10::ScalarType::Undefined ? ctx.dtype : out_dtype;
  if (dtype != c10::ScalarType::Undefined) warn_if_unportable(op, dtype);
  ctx.sig.flag(flags);
  commit(ctx.sig, schema.operator_name().name.c_str(), ctx.device,
         dtype == c10::ScalarType::Undefined ? c10::kFloat : dtype, ctx.bytes_in, bytes_out);
  return by_policy;
}

}  // namespace

void set_dtype_retry(DtypeRetry hook) { g_dtype_retry = hook; }
void set_dtype_ahead(DtypeRetry hook) { g_dtype_ahead = hook; }

bool add_dtype_policy_op(const std::string& name, const std::string& overload, bool ahead,
                         const std::vector<c10::ScalarType>& dtypes) {
  auto h = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!h) return false;  // a TorchScript-only overload (aten::acos.int): never dispatched here
  const void* schema = &h->schema();
  uint64_t mask = 0;
  static_assert(static_cast<int>(c10::ScalarType::NumOptions) <= 64, "a mask bit per dtype");
  for (c10::ScalarType d : dtypes) mask |= uint64_t{1} << static_cast<int>(d);
  TORCH_CHECK(mask != 0, "add_dtype_policy_op: ", name, " names no dtype");
  g_policy_ops[schema] |= mask;
  g_policy_filter.set(policy_slot(schema));
  if (ahead) g_ahead_ops.insert(schema);
  return true;
}

std::vector<std::pair<std::string, int64_t>> sync_op_counts(bool reset) {
  std::lock_guard<std::mutex> g(g_sync_mu);
  std::vector<std::pair<std::string, int64_t>> out;
  for (auto& [k, v] : g_sync_ops) out.emplace_back(k, v);
  if (reset) g_sync_ops.clear();
  return out;
}

// Ops with a CPU kernel and also a composite one: the composite would win on neuron and may
// round differently (e.g. native_layer_norm, addr, silu_backward) or take a slower out= path
// (structured ops). Route them to CPU's own kernel through the fallback instead.
std::vector<std::unique_ptr<torch::Library>> g_cpu_routes;

bool handled_here(const std::string& name) {
  static const std::set<std::string> own = {
      "aten::empty", "aten::empty_strided", "aten::_copy_from", "aten::_copy_from_and_resize",
      "aten::resize_", "aten::set_", "aten::view", "aten::as_strided", "aten::_reshape_alias",
      "aten::record_stream", "aten::copy_", "aten::_to_copy", "aten::to", "aten::clone",
      "aten::lift", "aten::lift_fresh", "aten::_local_scalar_dense"};
  return own.count(name) > 0;
}

int route_composites_to_cpu() {
  if (!g_cpu_routes.empty()) return 0;
  auto& disp = c10::Dispatcher::singleton();
  using K = c10::DispatchKey;
  // (CPU key, neuron key): dense, sparse COO and sparse compressed.
  const std::array<std::pair<K, K>, 3> pairs = {{{K::CPU, K::PrivateUse1},
                                                 {K::SparseCPU, K::SparsePrivateUse1},
                                                 {K::SparseCsrCPU, K::SparseCsrPrivateUse1}}};
  g_cpu_routes.clear();
  for (auto [cpu_key, key] : pairs) {
    g_cpu_routes.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key,
                                                            __FILE__, __LINE__));
  }
  int n = 0;
  for (const auto& name : disp.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = disp.findOp(name);
    if (!op) continue;
    bool explicit_composite = op->hasKernelForDispatchKey(K::CompositeExplicitAutograd) ||
                              op->hasKernelForDispatchKey(K::CompositeExplicitAutogradNonFunctional);
    // An implicit composite also supplies autograd; only ops with their own derivative
    // formula keep their gradient when a backend kernel is registered.
    bool implicit_with_grad = op->hasKernelForDispatchKey(K::CompositeImplicitAutograd) &&
                              op->hasKernelForDispatchKey(K::Autograd);
    if (!explicit_composite && !implicit_with_grad) continue;
    bool is_view = false;
    for (const auto& r : op->schema().returns()) {
      if (r.alias_info() && !r.alias_info()->isWrite()) is_view = true;
    }
    std::string full = name.name.substr(6);
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    // `_foreach_` ops: CPU runs them through their composite, one op per list index; on
    // neuron they reach the launcher whole, so Adaptive Eager can fuse a chain of them.
    bool foreach = name.name.rfind("aten::_foreach_", 0) == 0 && explicit_composite;
    for (size_t i = 0; i < pairs.size(); ++i) {
      auto [cpu_key, key] = pairs[i];
      bool has_cpu = op->hasKernelForDispatchKey(cpu_key) || (foreach && i == 0);
      if (!has_cpu || op->hasKernelForDispatchKey(key)) continue;
      // Dense views and our own kernels stay as they are; sparse views read the member
      // tensors through the sparse CPU kernel (see the fallback).
      if (key == K::PrivateUse1 && (is_view || handled_here(name.name))) continue;
      g_cpu_routes[i]->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
      ++n;
    }
  }
  return n;
}

std::vector<std::unique_ptr<torch::Library>> g_queue_routes;
std::mutex g_queue_routes_mu;
std::unordered_set<c10::OperatorName> g_queue_routed;

void route_to_queue(const std::string& qualified) {
  const auto sep = qualified.find("::");
  TORCH_CHECK_VALUE(sep != std::string::npos && sep > 0,
                    "neuron: route_to_queue takes 'namespace::op[.overload]', got '", qualified, "'");
  const std::string ns = qualified.substr(0, sep), rest = qualified.substr(sep + 2);
  const auto dot = rest.find('.');
  c10::OperatorName name(ns + "::" + rest.substr(0, dot),
                         dot == std::string::npos ? "" : rest.substr(dot + 1));
  auto op = c10::Dispatcher::singleton().findOp(name);
  TORCH_CHECK_VALUE(op.has_value(), "neuron: route_to_queue: no operator '", qualified,
                    "' is registered (is its library loaded?)");
  std::lock_guard<std::mutex> g(g_queue_routes_mu);
  if (g_queue_routed.count(name)) return;
  // hasKernelForDispatchKey sees direct registrations only: a catch-all or composite kernel
  // (what routing is for) is not one, while a library's own PrivateUse1 kernel is kept.
  if (!op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
    g_queue_routes.push_back(std::make_unique<torch::Library>(
        torch::Library::IMPL, ns, c10::DispatchKey::PrivateUse1, __FILE__, __LINE__));
    g_queue_routes.back()->impl(rest.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }
  g_queue_routed.insert(name);
}

bool routed_to_queue(const c10::OperatorName& name) {
  std::lock_guard<std::mutex> g(g_queue_routes_mu);
  return g_queue_routed.count(name) > 0;
}

// Strided nested tensors (torch.nested's default layout, and what the jagged layout's math
// SDPA and the Transformer fast path use): ATen's NestedTensorCPU kernels run on host aliases
// (CPU nested tensors over the device buffers), as dense ops run CPU's kernels.
void nested_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      op.hasKernelForDispatchKey(c10::DispatchKey::NestedTensorCPU), "The operator '",
      op.schema().operator_name(), "' is not available for nested tensors on the neuron device: ",
      "CPU has no nested kernel for it either (the jagged layout, torch.nested.nested_tensor(..., ",
      "layout=torch.jagged), covers more ops)");
  // The metadata's own accessors return it where it lives, on the host (as on CUDA).
  const auto& name = op.schema().name();
  if (name == "aten::_nested_tensor_size" || name == "aten::_nested_tensor_strides" ||
      name == "aten::_nested_tensor_storage_offsets") {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::NestedTensorCPU), stack);
    return;
  }
  queue::synchronize_all();
  run_now(op, stack);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// GroupNorm's backward on channels-last activations. CPU's autograd formula hands
// native_group_norm_backward the gradient and input in the input's memory format; off the CPU
// it makes them contiguous, and CPU's kernel sums the two layouts in different orders, so the
// gradients differed from CPU's in the last bits. The forward remembers (weakly, by the
// storage of its `mean` output, which autograd saves) which calls saw a channels-last input;
// their backward gets channels-last copies, as on the CPU. The copies are not charged: the
// chip's kernel reads either layout.
std::mutex g_gn_mutex;
std::vector<std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, c10::MemoryFormat>> g_gn_layouts;

void group_norm_forward(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& x = (*stack)[stack->size() - 8].toTensor();
  const auto fmt = x.suggest_memory_format();
  const bool strided = fmt != c10::MemoryFormat::Contiguous && !x.is_contiguous();
  fallback(op, stack);
  if (!strided) return;
  const auto& mean = (*stack)[stack->size() - 2].toTensor();
  std::lock_guard<std::mutex> lock(g_gn_mutex);
  g_gn_layouts.erase(std::remove_if(g_gn_layouts.begin(), g_gn_layouts.end(),
                                    [](const auto& e) { return e.first.expired(); }),
                     g_gn_layouts.end());
  auto storage = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
      mean.storage().unsafeGetStorageImpl());
  g_gn_layouts.emplace_back(c10::weak_intrusive_ptr<c10::StorageImpl>(storage), fmt);
}

void group_norm_backward(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // (grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)
  const size_t base = stack->size() - 10;
  auto fmt = c10::MemoryFormat::Contiguous;
  {
    const auto* storage = (*stack)[base + 2].toTensor().storage().unsafeGetStorageImpl();
    std::lock_guard<std::mutex> lock(g_gn_mutex);
    for (const auto& [weak, f] : g_gn_layouts) {
      if (weak._unsafe_get_target() == storage && !weak.expired()) fmt = f;
    }
  }
  if (fmt != c10::MemoryFormat::Contiguous) {
    struct Unrecorded {
      bool prev = set_recording(false);
      ~Unrecorded() { set_recording(prev); }
    } unrecorded;
    for (size_t i : {base, base + 1}) {
      const auto& t = (*stack)[i].toTensor();
      if (t.defined() && t.is_contiguous()) (*stack)[i] = t.contiguous(fmt);
    }
  }
  fallback(op, stack);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_group_norm", torch::CppFunction::makeFromBoxedFunction<&group_norm_forward>());
  m.impl("native_group_norm_backward",
         torch::CppFunction::makeFromBoxedFunction<&group_norm_backward>());
}


TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&nested_fallback>());
}

// A fallback serves only ops with no kernel for the key, and a composite (matmul's) counts as
// one: every op with a NestedTensorCPU kernel gets nested_fallback as its own kernel.
struct NestedKernels {
  std::vector<std::unique_ptr<torch::Library>> libs;
  NestedKernels() {
    auto& d = c10::Dispatcher::singleton();
    std::unordered_map<std::string, torch::Library*> by_ns;
    for (const auto& name : d.getRegistrationsForDispatchKey(c10::DispatchKey::NestedTensorCPU)) {
      auto op = d.findOp(name);
      if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::NestedTensorPrivateUse1)) continue;
      const auto sep = name.name.find("::");
      const std::string ns = name.name.substr(0, sep);
      auto& lib = by_ns[ns];
      if (!lib) {
        libs.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns,
                                                        c10::DispatchKey::NestedTensorPrivateUse1,
                                                        __FILE__, __LINE__));
        lib = libs.back().get();
      }
      std::string qualified = name.name.substr(sep + 2);
      if (!name.overload_name.empty()) qualified += "." + name.overload_name;
      lib->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&nested_fallback>());
    }
  }
};
const NestedKernels g_nested_kernels;

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

}  // namespace neuron
