// torch._grouped_mm's CPU kernel as a kernel on the device queue. The Python side
// (torch_neuronx/kernels/grouped_mm.py) launches it through compiled::launch_kernel, as
// scaled_mm.cpp's kernels are launched, so a MoE layer's grouped GEMMs queue behind the work
// before them instead of synchronising the host with the device (CPU's kernel reads the group
// offsets, which the device may still be computing). Why C++: the kernel runs on the
// executor thread, which holds no GIL.
#include "aten.h"

#include <ATen/ATen.h>

namespace neuron {
namespace {

// A tensor the launch keeps alive (it rides along as a kernel argument), from its TensorImpl.
at::Tensor borrowed(int64_t impl) {
  return at::Tensor(c10::intrusive_ptr<c10::TensorImpl>::unsafe_reclaim_from_nonowning(
      reinterpret_cast<c10::TensorImpl*>(impl)));
}

}  // namespace

// out = torch._grouped_mm(a, b, offs, bias, out_dtype), all of them device tensors (offs and
// bias optional: 0), computed by CPU's kernel on their memory: CPU's bits. The first five
// words are the data pointers the launch passes for its 'r'/'w' arguments (unused here); then
// the same tensors' TensorImpls (kept alive by the launch) and the ScalarType of `out`.
extern "C" void neuron_grouped_mm(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t a,
                                  int64_t b, int64_t offs, int64_t bias, int64_t out,
                                  int64_t out_dtype) {
  auto opt = [](int64_t impl) {
    return impl ? std::optional<at::Tensor>(cpu_alias(borrowed(impl))) : std::nullopt;
  };
  at::Tensor result = at::_grouped_mm(cpu_alias(borrowed(a)), cpu_alias(borrowed(b)), opt(offs),
                                      opt(bias), static_cast<at::ScalarType>(out_dtype));
  cpu_alias(borrowed(out)).copy_(result);
}

int64_t grouped_mm_entry() { return reinterpret_cast<int64_t>(&neuron_grouped_mm); }

}  // namespace neuron
