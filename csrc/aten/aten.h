// The ATen side: the kernels PyTorch cannot derive for a new device, the boxed fallback, the
// asynchronous launch path and autocast. Built on the runtime and the fusion window.
#pragma once

#include "../fusion/fusion.h"
#include "../runtime/runtime.h"

#include <torch/library.h>

namespace neuron {

namespace launch {
// Queues the op on `stack` to run asynchronously; false: it must run now.
// A signature seen for the first time fills `learning`; the caller runs the op now and then
// calls confirm() with the results on the stack.
bool try_launch(const c10::OperatorHandle& op, std::vector<c10::IValue>* stack,
                std::shared_ptr<void>* learning);
void confirm(std::shared_ptr<void>& learning, const c10::OperatorHandle& op,
             const std::vector<c10::IValue>& stack);
// The signature being learned must always run now.
void refuse(std::shared_ptr<void>& learning);
}  // namespace launch

// The device an op's optional device argument names (the current one if none), checked.
c10::DeviceIndex resolve_device(c10::optional<c10::Device> device);
// Route ops with both a CPU kernel and a composite to the CPU kernel (fallback.cpp).
int route_composites_to_cpu();
// Route another library's op (``ns::name`` or ``ns::name.overload``) on neuron tensors to the
// fallback, so its CPU kernel runs on the device's queue in stream order; one returning
// nothing launches asynchronously (plan.cpp). For catch-all composite kernels (vLLM's fused
// CPU attention), which would otherwise run at once on the calling thread.
void route_to_queue(const std::string& qualified);
bool routed_to_queue(const c10::OperatorName& name);
// Where CPU has no kernel for the arguments' dtypes but CUDA has, a Python policy
// (torch_neuronx/kernels/dtypes.py) computes CUDA's result on the host aliases. The hook gets
// the op and its stack (arguments at the top, already host aliases); it replaces them with
// the results and returns true, or returns false to let the CPU error stand. Only the ops
// named with add_dtype_policy_op reach it, and only with an argument of a dtype named there.
using DtypeRetry = bool (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack);
void set_dtype_retry(DtypeRetry hook);
// The same policy asked first, with the device tensors, where an op cannot be queued (no
// meta kernel takes its dtypes): where CPU's kernel would refuse them anyway, the policy
// computes with device ops and the host does not wait for the device to find that out.
// Asked only of the ops added with `ahead`: a hot op (add, lt) would pay a Python call on
// every synchronous run.
void set_dtype_ahead(DtypeRetry hook);
bool add_dtype_policy_op(const std::string& name, const std::string& overload, bool ahead,
                         const std::vector<c10::ScalarType>& dtypes);
// Ops that had to wait for the device although asynchronous launch was on, by name.
std::vector<std::pair<std::string, int64_t>> sync_op_counts(bool reset);

// Stochastic rounding (stochastic_rounding.cpp): while on, an op with a bf16/fp16 device
// tensor (or dtype) among its arguments, and a copy narrowing a float to bf16/fp16 on the
// device, go to Python hooks that compute in fp32 and round stochastically.
namespace sr {
// The hook computes the op on the stack and returns true, or returns false: not its case.
using OpHook = bool (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack);
using CopyHook = void (*)(const at::Tensor& src, const at::Tensor& dst);
bool active();  // on, and not inside a hook on this thread
bool enabled();
void set_enabled(bool on);
void set_hooks(OpHook op, CopyHook copy);
bool wants(const c10::OperatorHandle& op, const torch::jit::Stack& stack);
bool handle_op(const c10::OperatorHandle& op, torch::jit::Stack* stack);
bool narrowing_copy(const at::Tensor& src, const at::Tensor& dst);
void copy(const at::Tensor& src, const at::Tensor& dst);
}  // namespace sr

// torch._scaled_mm's FP8 x FP8 tensorwise product in oneDNN's reference order (scaled_mm.cpp):
// fp32 operands holding FP8 values, per-tensor scales; the fp32 result before bias and cast.
at::Tensor scaled_mm_sequential(const at::Tensor& a, const at::Tensor& b, double scale_a,
                                double scale_b);
// The address of the blockwise/MX product kernel that Python launches on the queue through
// compiled::launch_kernel (scaled_mm.cpp).
int64_t scaled_blocked_mm_entry();
// torch._grouped_mm's CPU kernel, launched on the queue (grouped_mm.cpp).
int64_t grouped_mm_entry();

namespace compiled {
// The most arguments a compiled kernel can take through launch_kernel.
constexpr size_t kMaxArgs = 512;
// Queue `fn`, an Inductor C++ kernel (extern "C", arguments pointers and int64 sizes), on
// the current stream of its tensors' device. kinds: one letter per argument, 'r' a pointer
// the kernel reads, 'w' one it writes, 'i' an int64; `tensors` gives the pointer arguments
// in order, `words` every argument as a 64-bit word. `work_bytes`: how much more than its
// tensors' bytes the kernel's work weighs (a matmul's), for the queue's size thresholds.
void launch_kernel(void* fn, const std::string& name, const std::string& kinds,
                   std::vector<at::Tensor> tensors, std::vector<int64_t> words,
                   int64_t work_bytes = 0);
}  // namespace compiled

}  // namespace neuron
