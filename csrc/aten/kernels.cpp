// The kernels PyTorch cannot derive for a new device: allocation, copies, resize and set_,
// metadata, the convolution and SDPA-choice entry points. Every other op goes through the
// boxed fallback (fallback.cpp).
#include "aten.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/clone_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/native/ConvUtils.h>
#include <ATen/native/ResizeCommon.h>
#include <ATen/native/TensorFactories.h>
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

#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

namespace neuron {

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

// torch.use_deterministic_algorithms(True) with fill_uninitialized_memory (the default): new
// memory holds NaN (floats) or the largest value (integers), as CPU's and CUDA's empty do.
bool deterministic_fill() {
  const auto& ctx = at::globalContext();
  return ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory();
}

at::Tensor fill_if_deterministic(at::Tensor t) {
  if (C10_UNLIKELY(deterministic_fill())) at::native::fill_empty_deterministic_(t);
  return t;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, c10::optional<c10::ScalarType> dtype,
                               c10::optional<c10::Layout> layout,
                               c10::optional<c10::Device> device, c10::optional<bool> pin_memory,
                               c10::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout || *layout == c10::kStrided, "neuron: empty() does not support layout ",
              *layout, " on the neuron device");
  (void)pin_memory;
  auto d = resolve(device);
  CurrentDevice g(d);
  return fill_if_deterministic(at::detail::empty_generic(
      size, allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype), memory_format));
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         c10::optional<c10::ScalarType> dtype, c10::optional<c10::Layout> layout,
                         c10::optional<c10::Device> device, c10::optional<bool> pin_memory) {
  TORCH_CHECK(!layout || *layout == c10::kStrided,
              "neuron: empty_strided() does not support layout ", *layout);
  (void)pin_memory;
  auto d = resolve(device);
  CurrentDevice g(d);
  return fill_if_deterministic(at::detail::empty_strided_generic(
      size, stride, allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype)));
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

// Does ATen's cast from `from` to `to` write the same bits for every value whichever of its
// loops converts it, NaNs included? Then the cast is exact and split-free for the fusion
// window (fusion::Op): where a fused kernel cuts the tensor (always into contiguous blocks)
// cannot change a bit. Probed once per pair: every pattern of a 1- or 2-byte type (hashed
// ones for wider types), converted in one call and in contiguous pieces of varied lengths
// (each value then meets ATen's vector loop and its tail). On this machine fp32 -> bf16 and
// bf16 -> fp32 agree; fp16 -> fp32 does not (a NaN widens to 0x7fffffff in the tail).
bool cast_split_free(c10::ScalarType from, c10::ScalarType to) {
  static std::mutex mu;
  static std::map<std::pair<c10::ScalarType, c10::ScalarType>, bool> known;
  std::lock_guard<std::mutex> g(mu);
  auto it = known.find({from, to});
  if (it != known.end()) return it->second;
  bool same = false;
  const int64_t width = int64_t(c10::elementSize(from));
  if (!c10::isComplexType(from) && !c10::isComplexType(to) && !c10::isQIntType(from) &&
      !c10::isQIntType(to) && width <= 8) {
    constexpr int64_t n = 65536 + 37;  // with a tail after the vector loop
    at::Tensor src;
    if (from == c10::kBool) {
      src = at::arange(n, at::kLong).remainder(2).to(c10::kBool);
    } else if (width <= 2) {
      src = at::arange(n, at::kInt).to(width == 1 ? at::kByte : at::kShort).view(from);
    } else {
      // a multiplicative hash of the index (not the global generator: the user's random
      // stream must not move)
      const int64_t words = (n * width + 7) / 8;
      src = at::arange(words, at::kLong).mul(int64_t(0x9E3779B97F4A7C15ull)).view(at::kByte)
                .slice(0, 0, n * width).view(from);
    }
    // the same values converted in contiguous pieces of varied lengths, so that each value
    // meets both the vector loop and its tail at some place
    at::Tensor pieces = at::empty({n}, src.options().dtype(to));
    static constexpr int64_t kLengths[] = {1, 3, 17, 31, 64, 100, 257};
    for (int64_t i = 0, k = 0; i < n; ++k) {
      const int64_t len = std::min(kLengths[k % 7], n - i);
      pieces.slice(0, i, i + len).copy_(src.slice(0, i, i + len));
      i += len;
    }
    auto bits = [](const at::Tensor& t) {
      switch (c10::elementSize(t.scalar_type())) {
        case 1: return t.view(at::kByte);
        case 2: return t.view(at::kShort);
        case 4: return t.view(at::kInt);
        default: return t.view(at::kLong);
      }
    };
    same = at::equal(bits(src.to(to)), bits(pieces));
  }
  known[{from, to}] = same;
  return same;
}

// A dtype cast between two contiguous device tensors of one shape (`x.float()`,
// `.to(torch.bfloat16)`: what bf16 blocks are made of) joins the device's Adaptive Eager
// window as ATen's `copy_`, a pointwise op like the others, instead of closing it. Only casts:
// a same-dtype copy stays a DMA copy, as on the chip. Where the cast's bits could depend on
// ATen's loop (cast_split_free), the window takes it only where its blocks are eager's.
bool join_window(const at::Tensor& self, const at::Tensor& dst, const at::Tensor& src_h,
                 const at::Tensor& dst_h, c10::DeviceIndex d) {
  if (!fusion::enabled() || self.scalar_type() == dst.scalar_type() || self.device() != dst.device() ||
      !self.is_contiguous() || !dst.is_contiguous() || self.sizes() != dst.sizes() ||
      (self.numel() < at::internal::GRAIN_SIZE && !fusion::holding(d)) || self.numel() == 0) {
    return false;
  }
  static const c10::OperatorHandle copy = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  fusion::Op f;
  f.kernel = copy;
  f.args = {dst, self, false};
  f.self = 0;
  f.overwrites = true;
  f.exact = f.split_free = cast_split_free(self.scalar_type(), dst.scalar_type());
  f.pure = self.numel() >= at::internal::GRAIN_SIZE;
  f.row = dst.dim() >= 2;
  f.numel = dst.numel();
  f.shape = dst.sizes().vec();
  f.name = "neuron::copy_d2d";  // alone (its window held only it), priced as the copy it was
  f.dtype = dst.scalar_type();
  f.shape_tensors = {self, dst};
  f.bytes_in = nbytes(self);
  f.bytes_out = nbytes(dst);
  f.run = [dst_h, src_h]() mutable { dst_h.copy_(src_h); };
  if (!f.pure && !f.row) return false;
  fusion::append(d, current_stream_id(d), std::move(f));
  return true;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  (void)non_blocking;
  if (sr::narrowing_copy(self, dst)) {  // a cast to bf16/fp16 with stochastic rounding on
    sr::copy(self, dst);
    return dst;
  }
  bool from_dev = self.device().type() == kDevice;
  bool to_dev = dst.device().type() == kDevice;
  at::Tensor src_h = host_side(self, "source");
  at::Tensor dst_h = host_side(dst, "destination");
  auto d = to_dev ? dst.device().index() : self.device().index();
  bool queued = to_dev && queue::asynchronous() && !check::enabled() &&
                (from_dev ? self.device().index() == d : nbytes(self) <= kSnapshotBytes) && dst_h.layout() == c10::kStrided &&
                src_h.layout() == c10::kStrided;
  if (queued && from_dev && join_window(self, dst, src_h, dst_h, d)) return dst;
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
  const auto old_nbytes = static_cast<int64_t>(self.storage().nbytes());
  resize_bytes(self, needed);
  if (C10_UNLIKELY(deterministic_fill())) {
    at::native::fill_resize_deterministic_(self, old_nbytes);
  }
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

// With stochastic rounding on, a bf16/fp16 convolution goes to the Python hook, which
// computes it in fp32 and rounds; nullopt: not its case.
template <typename... A>
std::optional<torch::jit::Stack> sr_convolution(const char* name, A&&... args) {
  if (!sr::active()) return std::nullopt;
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack;
  (stack.emplace_back(std::forward<A>(args)), ...);
  if (!sr::wants(op, stack) || !sr::handle_op(op, &stack)) return std::nullopt;
  return stack;
}

// The memory format CPU's convolution gives its results for these operands (its backend's
// choice): a queued convolution's outputs are allocated before the kernel runs. The check of
// the operands' shapes runs here too, so a bad convolution fails at the call, as on CPU.
at::MemoryFormat conv_format(const at::Tensor& in, const at::Tensor& w,
                             const c10::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                             c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                             c10::IntArrayRef output_padding, int64_t groups,
                             at::OptionalIntArrayRef bias_sizes) {
  auto sym = [](c10::IntArrayRef a) { return c10::fromIntArrayRefSlow(a); };
  auto backend = at::native::select_conv_backend(
      in, w, bias, sym(stride), sym(padding), sym(dilation), transposed, sym(output_padding),
      c10::SymInt(groups),
      bias_sizes ? at::OptionalSymIntArrayRef(sym(*bias_sizes)) : at::OptionalSymIntArrayRef());
  return in.dim() == 3 ? c10::MemoryFormat::Contiguous
                       : at::native::_determine_backend_memory_format(in, w, backend);
}

// Reads and writes of a queued convolution, for the stream checker; none when it is off.
void check_conv(const char* op, c10::DeviceIndex d, std::initializer_list<at::Tensor> reads,
                std::initializer_list<at::Tensor> writes) {
  if (!check::enabled()) return;
  std::vector<const void*> r, w;
  for (const auto& t : reads) if (t.defined()) r.push_back(t.storage().data());
  for (const auto& t : writes) if (t.defined()) w.push_back(t.storage().data());
  check::on_op(op, d, r, w);
}

at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const c10::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    bool transposed, c10::IntArrayRef output_padding,
                                    int64_t groups) {
  // As CUDA's convolution: the weight and bias are tensors of the input's device (a module
  // left on the CPU is an error, not a host convolution). Types are named as t.type() names
  // them (torch.neuron.FloatTensor).
  auto type_name = [](const at::Tensor& t) {
    return t.device().type() == kDevice
               ? std::string("torch.neuron.") + c10::toString(t.scalar_type()) + "Tensor"
               : t.toString();
  };
  for (const auto* t : {&weight, bias ? &*bias : nullptr}) {
    if (!t || !t->defined()) continue;
    TORCH_CHECK(t->device().type() == input.device().type(), "Input type (", type_name(input),
                ") and ", t == &weight ? "weight" : "bias", " type (", type_name(*t),
                ") should be the same");
    TORCH_CHECK(t->device() == input.device(), "Expected all tensors to be on the same device, "
                "but found at least two devices, ", input.device(), " and ", t->device(),
                "! (when checking argument '", t == &weight ? "weight" : "bias",
                "' of aten::convolution)");
  }
  if (auto r = sr_convolution("aten::convolution_overrideable", input, weight, bias, stride,
                              padding, dilation, transposed, output_padding, groups)) {
    return r->back().toTensor();
  }
  const auto d = input.device().index();
  Signature s;
  s.add(input);
  s.add(weight);
  // Charged and checked once its output exists, whether run now or queued.
  auto account = [&](const at::Tensor& out) {
    s.add(out);
    commit(s, "aten::convolution", d, input.scalar_type(), nbytes(input) + nbytes(weight),
           nbytes(out));
    check_conv("aten::convolution", d, {input, weight, bias.value_or(at::Tensor())}, {out});
  };
  if (!queue::asynchronous() || check::enabled()) {
    queue::synchronize_all();
    queue::HostThreads threads;
    auto out = at::convolution(cpu_alias(input), cpu_alias(weight), alias_opt(bias), stride,
                               padding, dilation, transposed, output_padding, groups);
    account(out);
    return adopt_tensor(out, d);
  }
  // Queued like any other op, so the host does not wait for the device (and CPU's parallel
  // kernel runs on the executor's OpenMP team, not on a second one in the calling thread).
  auto in_h = cpu_alias(input), w_h = cpu_alias(weight);
  auto fmt = conv_format(in_h, w_h, alias_opt(bias), stride, padding, dilation, transposed,
                         output_padding, groups, c10::nullopt);
  auto sizes = transposed ? at::native::conv_input_size(in_h.sizes(), w_h.sizes(), padding,
                                                        output_padding, stride, dilation, groups)
                          : at::native::conv_output_size(in_h.sizes(), w_h.sizes(), padding,
                                                         stride, dilation);
  auto out = at::empty(sizes, input.options().memory_format(fmt));
  account(out);
  fusion::count_launch();
  std::vector<int64_t> st(stride.vec()), pad(padding.vec()), dil(dilation.vec()),
      opad(output_padding.vec());
  // The work holds aliases taken now, as other launches do: later metadata changes of the
  // arguments (`t_()`) do not reach it, and the allocator keeps freed blocks out of reuse
  // until it has run.
  queue::launch(d, current_stream_id(d), "aten::convolution",
                [in_h, w_h, b_h = alias_opt(bias), out_h = cpu_alias(out), st, pad, dil,
                 transposed, opad, groups]() mutable {
                  out_h.copy_(at::convolution(in_h, w_h, b_h, st, pad, dil, transposed, opad,
                                              groups));
                },
                nbytes(input) + nbytes(weight) + nbytes(out));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  if (auto r = sr_convolution("aten::convolution_backward_overrideable", grad_output, input,
                              weight, stride, padding, dilation, transposed, output_padding,
                              groups, output_mask)) {
    auto& st = *r;
    return {st[st.size() - 3].toTensor(), st[st.size() - 2].toTensor(), st.back().toTensor()};
  }
  std::vector<int64_t> bias_sizes{transposed ? weight.size(1) * groups : weight.size(0)};
  const auto d = input.device().index();
  Signature s;
  s.add(grad_output);
  s.add(input);
  s.add(weight);
  const int64_t bytes_in = nbytes(grad_output) + nbytes(input) + nbytes(weight);
  auto account = [&](const at::Tensor& gi, const at::Tensor& gw, const at::Tensor& gb) {
    commit(s, "aten::convolution_backward", d, input.scalar_type(), bytes_in,
           (gi.defined() ? nbytes(gi) : 0) + (gw.defined() ? nbytes(gw) : 0));
    check_conv("aten::convolution_backward", d, {grad_output, input, weight}, {gi, gw, gb});
  };
  if (!queue::asynchronous() || check::enabled()) {
    queue::synchronize_all();
    queue::HostThreads threads;
    auto [gi, gw, gb] = at::convolution_backward(
        cpu_alias(grad_output), cpu_alias(input), cpu_alias(weight), bias_sizes, stride, padding,
        dilation, transposed, output_padding, groups, output_mask);
    account(gi, gw, gb);
    return {adopt_opt(gi, d), adopt_opt(gw, d), adopt_opt(gb, d)};
  }
  auto in_h = cpu_alias(input), w_h = cpu_alias(weight);
  auto fmt = conv_format(in_h, w_h, c10::nullopt, stride, padding, dilation, transposed,
                         output_padding, groups, bias_sizes);
  at::Tensor gi, gw, gb;
  if (output_mask[0]) gi = at::empty(input.sizes(), input.options().memory_format(fmt));
  if (output_mask[1]) gw = at::empty(weight.sizes(), weight.options().memory_format(fmt));
  if (output_mask[2]) gb = at::empty(bias_sizes, weight.options());
  account(gi, gw, gb);
  fusion::count_launch();
  std::vector<int64_t> st(stride.vec()), pad(padding.vec()), dil(dilation.vec()),
      opad(output_padding.vec());
  queue::launch(
      d, current_stream_id(d), "aten::convolution_backward",
      [go_h = cpu_alias(grad_output), in_h, w_h, gi_h = alias_opt(gi), gw_h = alias_opt(gw),
       gb_h = alias_opt(gb), bias_sizes, st, pad, dil, transposed, opad, groups,
       output_mask]() mutable {
        auto [ri, rw, rb] = at::convolution_backward(go_h, in_h, w_h, bias_sizes, st, pad, dil,
                                                     transposed, opad, groups, output_mask);
        if (gi_h && gi_h->defined()) gi_h->copy_(ri);
        if (gw_h && gw_h->defined()) gw_h->copy_(rw);
        if (gb_h && gb_h->defined()) gb_h->copy_(rb);
      },
      bytes_in + (gi.defined() ? nbytes(gi) : 0) + (gw.defined() ? nbytes(gw) : 0));
  return {gi, gw, gb};
}

// scaled_dot_product_attention picks its kernel through a per-device stub; CPU's choice
// (flash attention for CPU, or math) keeps results identical to CPU.
int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         c10::optional<double> scale, bool enable_gqa) {
  // A program written for CUDA may allow only CUDA's memory-efficient or cuDNN kernels
  // (`sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)`), for which CPU's selection finds nothing:
  // neuron runs those ops too (kernels/attention.py), on what CUDA's take (dense 4-D, as many
  // key/value heads as query heads).
  const auto& ctx = at::globalContext();
  if (!ctx.userEnabledFlashSDP() && !ctx.userEnabledMathSDP() && q.dim() == 4 && k.dim() == 4 &&
      v.dim() == 4 && !q.is_nested() && q.size(1) == k.size(1) && k.size(1) == v.size(1) &&
      at::isFloatingType(q.scalar_type())) {
    if (ctx.userEnabledMemEfficientSDP()) {
      return static_cast<int64_t>(at::SDPBackend::efficient_attention);
    }
    if (ctx.userEnabledCuDNNSDP()) return static_cast<int64_t>(at::SDPBackend::cudnn_attention);
  }
  // CPU's selection reads only metadata; called directly so fake tensors (torch.compile)
  // work too.
  return at::native::_fused_sdp_choice_cpp(q, k, v, mask, dropout_p, is_causal, scale,
                                           enable_gqa);
}

// clone() as CUDA's (a fresh tensor of the same layout, copied), keeping backend metadata
// (torch._utils.set_tensor_metadata) as detach() does: a flag describing a tensor's contents
// stays true of its copy, and copy.deepcopy of modules clones parameters.
at::Tensor clone(const at::Tensor& self, std::optional<c10::MemoryFormat> memory_format) {
  auto out = at::native::clone(self, memory_format);
  auto* impl = self.unsafeGetTensorImpl();
  if (impl->get_backend_meta()) {
    auto meta = impl->get_backend_meta_intrusive_ptr();
    out.unsafeGetTensorImpl()->set_backend_meta(meta->clone(meta));
  }
  return out;
}

}  // namespace

c10::DeviceIndex resolve_device(c10::optional<c10::Device> device) { return resolve(device); }

}  // namespace neuron

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &neuron::fused_sdp_choice)
}  // namespace at::native

namespace neuron {

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
  m.impl("clone", TORCH_FN(clone));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
  m.impl("convolution_overrideable", TORCH_FN(convolution_overrideable));
  m.impl("convolution_backward_overrideable", TORCH_FN(convolution_backward_overrideable));
}

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
