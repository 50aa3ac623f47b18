// Device memory is host memory: a device tensor and a CPU tensor can share one buffer. These
// are the two directions every kernel path uses: a CPU view of device memory (to run a CPU
// kernel on it) and device ownership of a CPU kernel's fresh output.
#include "runtime.h"

#include <ATen/EmptyTensor.h>

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

at::Tensor wrap_storage(c10::Storage storage, const at::Tensor& like) {
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

at::Tensor adopt_tensor(const at::Tensor& cpu, c10::DeviceIndex d) {
  TORCH_CHECK(cpu.layout() == c10::kStrided,
              "neuron: a kernel produced a tensor with layout ", cpu.layout(),
              ", which the neuron device does not support");
  c10::Storage st(c10::Storage::use_byte_size_t(), cpu.storage().nbytes(),
                  adopt(cpu.storage(), d), allocator(), /*resizable=*/true);
  return wrap_storage(std::move(st), cpu);
}

}  // namespace neuron
