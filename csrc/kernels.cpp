// The kernels PyTorch cannot derive for a new device (allocation, copies, metadata, conv
// entry points) and one boxed fallback that runs every other op's CPU kernel on zero-copy
// aliases of device memory: device memory is host memory, so no data moves.
#include "neuron.h"

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

at::Tensor cpu_alias(const at::Tensor& t) {
  const auto& st = t.storage();
  // Resizable with the CPU allocator: an `out=` kernel may grow it; the fallback then moves
  // the grown buffer back into device ownership.
  c10::Storage s(c10::Storage::use_byte_size_t(), st.nbytes(),
                 c10::DataPtr(const_cast<void*>(st.data()), c10::Device(c10::kCPU)),
                 c10::GetAllocator(c10::kCPU), /*resizable=*/true);
  auto keys = c10::DispatchKeySet(c10::DispatchKey::CPU);
  if (t._is_zerotensor()) keys = keys.add(c10::DispatchKey::ZeroTensor);
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(s), keys, t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) out._set_conj(true);
  if (t.is_neg()) out._set_neg(true);
  return out;
}

namespace {

at::Tensor wrap(c10::Storage storage, const at::Tensor& like) {
  // Efficient zero tensors (autograd's zero gradients) have no memory: keep their key.
  auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  if (like._is_zerotensor()) keys = keys.add(c10::DispatchKey::ZeroTensor);
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                   like.storage_offset());
  if (like.is_conj()) out._set_conj(true);
  if (like.is_neg()) out._set_neg(true);
  return out;
}

}  // namespace

at::Tensor adopt_tensor(const at::Tensor& cpu, c10::DeviceIndex d) {
  TORCH_CHECK(cpu.layout() == c10::kStrided,
              "neuron: a kernel produced a tensor with layout ", cpu.layout(),
              ", which the neuron device does not support");
  c10::Storage st(c10::Storage::use_byte_size_t(), cpu.storage().nbytes(),
                  adopt(cpu.storage(), d), allocator(), /*resizable=*/true);
  return wrap(std::move(st), cpu);
}

// ---------------------------------------------------------------------------------------
// Op record for the cost model: counts per (op, device, dtype, input shapes).
namespace {

struct RecordKey {
  const char* name;
  int8_t device;
  int8_t dtype;
  uint8_t len;
  int64_t stream;
  int64_t epoch;  // see timeline_epoch(): work of different epochs never overlaps
  std::array<int64_t, 16> sig;
  bool operator==(const RecordKey& o) const {
    return name == o.name && device == o.device && dtype == o.dtype && len == o.len &&
           stream == o.stream && epoch == o.epoch &&
           std::equal(sig.begin(), sig.begin() + len, o.sig.begin());
  }
};
struct RecordKeyHash {
  size_t operator()(const RecordKey& k) const {
    size_t h = std::hash<const void*>()(k.name) ^ (size_t(k.device) << 8) ^ (size_t(k.dtype) << 16) ^
               (size_t(k.stream) << 24) ^ (size_t(k.epoch) << 32);
    for (int i = 0; i < k.len; ++i) h = h * 1000003u ^ std::hash<int64_t>()(k.sig[i]);
    return h;
  }
};
struct RecordValue {
  int64_t count = 0;
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
};

std::mutex g_record_mu;
std::unordered_map<RecordKey, RecordValue, RecordKeyHash> g_records;
// Set while printing: tensor printing computes in float64 internally, not the user.
thread_local bool t_quiet = false;

// Shapes of the first few tensors, each as [ndim, sizes...].
struct Signature {
  RecordKey key{};
  int tensors = 0;
  void add(const at::Tensor& t) {
    if (tensors == 3) return;
    int nd = t.dim();
    if (key.len + 1 + nd > 16) return;
    key.sig[key.len++] = nd;
    for (int i = 0; i < nd; ++i) key.sig[key.len++] = t.size(i);
    ++tensors;
  }
};

void commit(Signature& s, const char* name, c10::DeviceIndex d, c10::ScalarType dtype,
            int64_t bytes_in, int64_t bytes_out) {
  s.key.name = name;
  s.key.device = static_cast<int8_t>(d);
  s.key.dtype = static_cast<int8_t>(dtype);
  s.key.stream = current_stream_id(d);
  s.key.epoch = timeline_epoch(d, s.key.stream);
  std::lock_guard<std::mutex> g(g_record_mu);
  auto& v = g_records[s.key];
  v.count += 1;
  v.bytes_in += bytes_in;
  v.bytes_out += bytes_out;
}

int64_t nbytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

}  // namespace

void record_op(const char* name, c10::DeviceIndex d, c10::ScalarType dtype,
               c10::ArrayRef<at::Tensor> shape_tensors, int64_t bytes_in, int64_t bytes_out) {
  Signature s;
  for (const auto& t : shape_tensors) s.add(t);
  commit(s, name, d, dtype, bytes_in, bytes_out);
}

std::vector<std::pair<std::string, int64_t>> sync_op_counts(bool reset);

void record_fused(c10::DeviceIndex d, c10::ScalarType dtype, int64_t numel, int64_t n_ops,
                  int64_t bytes_in, int64_t bytes_out) {
  Signature s;
  s.key.sig[0] = 2;
  s.key.sig[1] = numel;
  s.key.sig[2] = n_ops;
  s.key.len = 3;
  commit(s, "neuron::fused_pointwise", d, dtype, bytes_in, bytes_out);
}

void set_quiet(bool on) { t_quiet = on; }
bool quiet() { return t_quiet; }


std::vector<std::tuple<std::string, int, int, std::vector<int64_t>, int64_t, int64_t, int64_t,
                       int64_t, int64_t>>
drain_records() {
  std::unordered_map<RecordKey, RecordValue, RecordKeyHash> taken;
  {
    std::lock_guard<std::mutex> g(g_record_mu);
    taken.swap(g_records);
  }
  std::vector<std::tuple<std::string, int, int, std::vector<int64_t>, int64_t, int64_t, int64_t,
                         int64_t, int64_t>> out;
  out.reserve(taken.size());
  for (auto& kv : taken) {
    const auto& k = kv.first;
    out.emplace_back(std::string(k.name), int(k.device), int(k.dtype),
                     std::vector<int64_t>(k.sig.begin(), k.sig.begin() + k.len), kv.second.count,
                     kv.second.bytes_in, kv.second.bytes_out, k.stream, k.epoch);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
namespace {

// Dtypes Trainium has no engine support for: they run here, and warn once per op.
bool unportable(c10::ScalarType t) {
  return t == c10::kDouble || t == c10::kComplexFloat || t == c10::kComplexDouble ||
         t == c10::kComplexHalf;
}

std::mutex g_warn_mu;
std::set<std::pair<const void*, int>> g_warned;

void warn_unportable(const c10::OperatorHandle& op, c10::ScalarType t) {
  if (t_quiet) return;
  auto key = std::make_pair(static_cast<const void*>(&op.operator_name()), int(t));
  {
    std::lock_guard<std::mutex> g(g_warn_mu);
    if (!g_warned.insert(key).second) return;
  }
  TORCH_WARN("neuron: ", op.operator_name(), " ran on ", t,
             ", which Trainium's engines do not support; it runs on the virtual NeuronCore "
             "but will not port to the chip as is (warned once per op and dtype).");
}

}  // namespace

void warn_if_unportable(const c10::OperatorHandle& op, c10::ScalarType t) {
  if (unportable(t)) warn_unportable(op, t);
}

namespace {

c10::DeviceIndex resolve(c10::optional<c10::Device> device) {
  c10::DeviceIndex d = (device && device->has_index()) ? device->index() : current_device();
  check_device(d);
  return d;
}

struct CurrentDevice {
  c10::DeviceIndex prev;
  explicit CurrentDevice(c10::DeviceIndex d) : prev(current_device()) {
    if (d != prev) set_current_device(d);
  }
  ~CurrentDevice() {
    if (current_device() != prev) set_current_device(prev);
  }
};

at::Tensor empty_memory_format(c10::IntArrayRef size, c10::optional<c10::ScalarType> dtype,
                               c10::optional<c10::Layout> layout,
                               c10::optional<c10::Device> device, c10::optional<bool> pin_memory,
                               c10::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout || *layout == c10::kStrided, "neuron: empty() does not support layout ",
              *layout, " on the neuron device");
  (void)pin_memory;
  auto d = resolve(device);
  CurrentDevice g(d);
  return at::detail::empty_generic(size, allocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         c10::optional<c10::ScalarType> dtype, c10::optional<c10::Layout> layout,
                         c10::optional<c10::Device> device, c10::optional<bool> pin_memory) {
  TORCH_CHECK(!layout || *layout == c10::kStrided,
              "neuron: empty_strided() does not support layout ", *layout);
  (void)pin_memory;
  auto d = resolve(device);
  CurrentDevice g(d);
  return at::detail::empty_strided_generic(size, stride, allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor host_side(const at::Tensor& t, const char* role) {
  if (t.device().type() == kDevice) return cpu_alias(t);
  TORCH_CHECK(t.device().is_cpu(), "neuron: copy_ between ", t.device(),
              " and a neuron tensor is not supported (", role, " is on ", t.device(), ")");
  return t;
}

// Copies queue like kernels, except copies to the host (a host read: wait for the device)
// and large host-to-device copies (CUDA also copies pageable memory synchronously). A small
// host source is snapshotted, so the caller may reuse its buffer at once.
constexpr int64_t kSnapshotBytes = 1 << 20;

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  (void)non_blocking;
  bool from_dev = self.device().type() == kDevice;
  bool to_dev = dst.device().type() == kDevice;
  at::Tensor src_h = host_side(self, "source");
  at::Tensor dst_h = host_side(dst, "destination");
  auto d = to_dev ? dst.device().index() : self.device().index();
  bool queued = to_dev && queue::asynchronous() && !check::enabled() &&
                (from_dev ? self.device().index() == d : nbytes(self) <= kSnapshotBytes) && dst_h.layout() == c10::kStrided &&
                src_h.layout() == c10::kStrided;
  if (queued) {
    if (!from_dev) src_h = src_h.clone();
    fusion::count_launch();
    queue::launch(d, current_stream_id(d), "aten::copy_",
                  [dst_h, src_h]() mutable { dst_h.copy_(src_h); }, 2 * nbytes(dst_h));
  } else {
    if (from_dev || to_dev) queue::synchronize_all();
    dst_h.copy_(src_h);
  }
  if (check::enabled()) {
    std::vector<const void*> reads, writes;
    if (from_dev) reads.push_back(self.storage().data());
    if (to_dev) writes.push_back(dst.storage().data());
    check::on_op("aten::copy_", d, reads, writes);
    // A copy to the host waits for the stream that produced the data.
    if (!to_dev) check::on_stream_sync(d, current_stream_id(d));
  }
  Signature s;
  s.add(dst);
  const char* kind = from_dev ? (to_dev ? "neuron::copy_d2d" : "neuron::copy_d2h")
                              : "neuron::copy_h2d";
  commit(s, kind, d, dst.scalar_type(), nbytes(self), nbytes(dst));
  return dst;
}

void resize_bytes(const at::Tensor& self, size_t needed) {
  auto* st = self.storage().unsafeGetStorageImpl();
  if (needed <= st->nbytes()) return;
  TORCH_CHECK(st->resizable(), "neuron: trying to resize storage that is not resizable");
  at::detail::getPrivateUse1Hooks().resizePrivateUse1Bytes(self.storage(), needed);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          c10::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (memory_format && *memory_format != c10::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  size_t needed = at::detail::computeStorageNbytes(size, impl->strides(), self.element_size(),
                                                   impl->storage_offset());
  resize_bytes(self, needed);
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sizes(), c10::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage source, int64_t offset,
                               c10::IntArrayRef size, c10::IntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  c10::optional<c10::IntArrayRef> st = stride.empty() ? c10::nullopt
                                                      : c10::optional<c10::IntArrayRef>(stride);
  impl->set_sizes_and_strides(size, st ? *st : c10::IntArrayRef(c10::contiguous_strides(size)),
                              offset);
  size_t needed = at::detail::computeStorageNbytes(size, impl->strides(), self.element_size(),
                                                   offset);
  resize_bytes(self, needed);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes() / self.element_size());
  return set_storage_offset(self, std::move(source), 0, {n}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  if (!self.is_same(source)) {
    set_storage_offset(self, source.storage(), source.storage_offset(), source.sizes(),
                       source.strides());
  }
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage st(c10::Storage::use_byte_size_t(), 0,
                  allocate_on(0, self.device().index()), allocator(), true);
  return set_storage_offset(self, std::move(st), 0, {0}, {});
}

// `module.to("neuron")` swaps a parameter's data in place (keeping tied weights tied, as
// on CUDA) only when CPU and device tensors may share a TensorImpl type.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense_here = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_quantized() && !t.is_nested() &&
           (t.device().is_cpu() || t.device().type() == kDevice);
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) ||
         (dense_here(self) && dense_here(from));
}

void record_stream(at::Tensor& self, c10::Stream stream) {
  allocator()->recordStream(self.storage().data_ptr(), stream);
  if (check::enabled()) {
    check::on_record_stream(self.storage().data(), stream.device_index(), stream.id());
  }
}

c10::optional<at::Tensor> alias_opt(const c10::optional<at::Tensor>& t) {
  if (!t || !t->defined()) return t;
  return cpu_alias(*t);
}

at::Tensor adopt_opt(const at::Tensor& t, c10::DeviceIndex d) {
  return t.defined() ? adopt_tensor(t, d) : t;
}

at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const c10::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    bool transposed, c10::IntArrayRef output_padding,
                                    int64_t groups) {
  queue::synchronize_all();
  auto out = at::convolution(cpu_alias(input), cpu_alias(weight), alias_opt(bias), stride,
                             padding, dilation, transposed, output_padding, groups);
  Signature s;
  s.add(input);
  s.add(weight);
  s.add(out);
  commit(s, "aten::convolution", input.device().index(), input.scalar_type(),
         nbytes(input) + nbytes(weight), nbytes(out));
  return adopt_tensor(out, input.device().index());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  queue::synchronize_all();
  std::vector<int64_t> bias_sizes{transposed ? weight.size(1) * groups : weight.size(0)};
  auto [gi, gw, gb] = at::convolution_backward(
      cpu_alias(grad_output), cpu_alias(input), cpu_alias(weight), bias_sizes, stride, padding,
      dilation, transposed, output_padding, groups, output_mask);
  auto d = input.device().index();
  Signature s;
  s.add(grad_output);
  s.add(input);
  s.add(weight);
  commit(s, "aten::convolution_backward", d, input.scalar_type(),
         nbytes(grad_output) + nbytes(input) + nbytes(weight), nbytes(gi) + nbytes(gw));
  return {adopt_opt(gi, d), adopt_opt(gw, d), adopt_opt(gb, d)};
}

// scaled_dot_product_attention picks its kernel through a per-device stub; CPU's choice
// (flash attention for CPU, or math) keeps results identical to CPU.
int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         c10::optional<double> scale, bool enable_gqa) {
  // CPU's selection reads only metadata; called directly so fake tensors (torch.compile)
  // work too.
  return at::native::_fused_sdp_choice_cpp(q, k, v, mask, dropout_p, is_causal, scale,
                                           enable_gqa);
}

// ---------------------------------------------------------------------------------------
// The boxed fallback.

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

  bool sparse = false;
  std::vector<const void*> reads, writes;  // for the stream checker

  at::Tensor to_host(const at::Tensor& t, bool mutable_arg) {
    auto d = t.device().index();
    if (device == -1) device = d;
    else if (d != device) other = d;
    if (t.layout() != c10::kStrided) {
      sparse = true;
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
  if (t.layout() != c10::kStrided) {
    TORCH_CHECK(t.layout() == c10::kSparse || is_compressed(t), "neuron: a kernel produced a ",
                t.layout(), " tensor, a layout the neuron device does not support");
    return rebuild_sparse(t, c10::Device(kDevice, ctx.device),
                          [&](const at::Tensor& m) { return to_device(m, ctx, fresh); });
  }
  const auto* key = t.storage().unsafeGetStorageImpl();
  for (auto& [k, st] : ctx.storages) {
    if (k == key) return wrap(st, t);
  }
  for (auto& [k, st] : fresh) {
    if (k == key) return wrap(st, t);
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

void run_now(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Ops that had to wait for the device although asynchronous launch was on, by name: what
// `torch_neuronx.queue_stats()` reports to explain lost overlap.
std::mutex g_sync_mu;
std::unordered_map<const char*, int64_t> g_sync_ops;
void count_sync(const char* name) {
  std::lock_guard<std::mutex> g(g_sync_mu);
  ++g_sync_ops[name];
}

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
  // In-place view ops (t_, squeeze_) change metadata only: no need to wait for the device.
  std::shared_ptr<void> learning;
  if (!op.hasTag(at::Tag::inplace_view)) {
    if (queue::asynchronous() && !check::enabled()) {
      if (launch::try_launch(op, stack, &learning)) return;
      if (!learning) count_sync(schema.operator_name().name.c_str());
    }
    queue::synchronize_all();
  }
  run_now(op, stack);
  if (learning) launch::confirm(learning, op, *stack);
}

void run_now(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const auto& rets = schema.returns();
  const size_t n = args.size();
  const size_t base = stack->size() - n;
  Context ctx;
  c10::SmallVector<std::pair<size_t, c10::IValue>, 2> originals;  // mutable args as passed
  int gen_slot = -1;
  at::Generator gen_dev;

  for (size_t i = 0; i < n; ++i) {
    c10::IValue& iv = (*stack)[base + i];
    const auto* alias = args[i].alias_info();
    bool mut = alias && alias->isWrite();
    if (iv.isTensor()) {
      const at::Tensor& t = iv.toTensor();
      if (!t.defined()) continue;
      if (t.device().type() == kDevice) {
        if (mut) originals.emplace_back(i, iv);
        iv = ctx.to_host(t, mut);
      } else if (t.device().is_cpu() && t.dim() > 0 && ctx.cpu_arg.empty() &&
                 !(args[i].name() == "scalars" && schema.name().rfind("aten::_foreach_", 0) == 0)) {
        // (A `_foreach_` op's per-tensor `scalars` live on the CPU, as on CUDA.)
        ctx.cpu_arg = args[i].name();
      }
    } else if (iv.isList()) {
      auto list = iv.toList();
      bool any = false;
      for (size_t k = 0; k < list.size(); ++k) {
        if (is_device_tensor(list.get(k))) { any = true; break; }
      }
      if (!any) continue;
      if (mut) originals.emplace_back(i, iv);
      auto copy = list.copy();
      for (size_t k = 0; k < copy.size(); ++k) {
        c10::IValue e = copy.get(k);
        if (is_device_tensor(e)) copy.set(k, ctx.to_host(e.toTensor(), mut));
      }
      iv = std::move(copy);
    } else if (iv.isDevice()) {
      auto d = iv.toDevice();
      if (d.type() == kDevice) {
        auto idx = resolve(d);
        if (ctx.device == -1) ctx.device = idx;
        iv = c10::Device(c10::kCPU);
      }
    } else if (iv.isGenerator()) {
      auto g = iv.toGenerator();
      if (g.device().type() == kDevice) {
        gen_slot = static_cast<int>(i);
        gen_dev = g;
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

  try {
    if (ctx.sparse) {
      // Sparse host aliases carry their own dispatch keys (SparseCPU, SparseCsrCPU).
      c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
      op.callBoxed(stack);
    } else {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    }
  } catch (c10::NotImplementedError& e) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "The operator '", schema.operator_name(),
                                "' is not available on the neuron device: the virtual "
                                "NeuronCore runs CPU kernels and CPU has none for these "
                                "arguments. ", e.what_without_backtrace());
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
  if (dtype != c10::ScalarType::Undefined && unportable(dtype)) warn_unportable(op, dtype);
  commit(ctx.sig, schema.operator_name().name.c_str(), ctx.device,
         dtype == c10::ScalarType::Undefined ? c10::kFloat : dtype, ctx.bytes_in, bytes_out);
}

}  // namespace
}  // namespace neuron

namespace neuron {
std::vector<std::pair<std::string, int64_t>> sync_op_counts(bool reset) {
  std::lock_guard<std::mutex> g(g_sync_mu);
  std::vector<std::pair<std::string, int64_t>> out;
  for (auto& [k, v] : g_sync_ops) out.emplace_back(k, v);
  if (reset) g_sync_ops.clear();
  return out;
}
}  // namespace neuron

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &neuron::fused_sdp_choice)
}  // namespace at::native

namespace neuron {

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

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(aten, SparsePrivateUse1, m) {
  m.impl("_sparse_coo_tensor_with_dims_and_tensors",
         TORCH_FN(at::native::new_with_dims_and_tensor_sparse_symint));
  m.impl("_sparse_coo_tensor_with_dims", TORCH_FN(at::native::new_with_dims_sparse));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage", TORCH_FN(set_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  m.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("record_stream", TORCH_FN(record_stream));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
  m.impl("convolution_overrideable", TORCH_FN(convolution_overrideable));
  m.impl("convolution_backward_overrideable", TORCH_FN(convolution_backward_overrideable));
}

// Autocast: CUDA's op policy, on the neuron dispatch key.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

namespace autocast_policy {
using namespace at::autocast;
using at::Tensor;
using c10::IntArrayRef;
using c10::Scalar;
using c10::ScalarType;
using c10::SymInt;
using c10::SymIntArrayRef;
using std::optional;

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define _NEURON_LOW(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define _NEURON_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define _NEURON_FP32_OPT(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define _NEURON_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(_NEURON_LOW)
  AT_FORALL_FP32(_NEURON_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(_NEURON_FP32_OPT)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(_NEURON_PROMOTE)
#undef _NEURON_LOW
#undef _NEURON_FP32
#undef _NEURON_FP32_OPT
#undef _NEURON_PROMOTE
}
}  // namespace autocast_policy

}  // namespace neuron

namespace neuron {
// Copies honour conjugate and negative bits themselves (the CPU alias keeps them), so the
// math-bit fallbacks must not materialise first: that would copy, and recurse.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
}  // namespace neuron
