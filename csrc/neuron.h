// Shared declarations of the neuron runtime glue: the device table, the caching allocator
// over host memory, and the op record the cost model reads.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/FunctionRef.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace neuron {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

// Devices (configured once from Python, which reads the NEURON_* environment).
c10::DeviceIndex device_count();
void set_device_count(int n);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex d);
void check_device(c10::DeviceIndex d);  // clear error for an index out of range

// The caching allocator.
c10::DeviceAllocator* allocator();
c10::DataPtr allocate_on(size_t n, c10::DeviceIndex d);
void set_memory_limit(c10::DeviceIndex d, int64_t bytes);
// Take ownership of host memory a CPU kernel produced, as device memory of `d`.
c10::DataPtr adopt(c10::Storage cpu_storage, c10::DeviceIndex d);
c10::Allocator* pinned_allocator();
bool is_pinned(const void* p);


// Generators.
const at::Generator& default_generator(c10::DeviceIndex d);
at::Generator new_generator(c10::DeviceIndex d);

// Zero-copy CPU view of a device tensor.
at::Tensor cpu_alias(const at::Tensor& t);
// Device tensor over the memory of a fresh CPU tensor.
at::Tensor adopt_tensor(const at::Tensor& cpu, c10::DeviceIndex d);

int64_t current_stream_id(c10::DeviceIndex d);

// The modelled timeline's epochs: work on different streams of one epoch overlaps; a cross-
// stream wait or a host synchronization starts a new epoch. Epochs stay 0 until a device
// uses a second stream, so single-stream programs aggregate into one record per op shape.
int64_t timeline_epoch(c10::DeviceIndex d, int64_t stream);
void timeline_barrier(c10::DeviceIndex d);

// The cost model's op record and the once-per-op warning for dtypes Trainium lacks.
void record_op(const char* name, c10::DeviceIndex d, c10::ScalarType dtype,
               c10::ArrayRef<at::Tensor> shape_tensors, int64_t bytes_in, int64_t bytes_out);
void warn_if_unportable(const c10::OperatorHandle& op, c10::ScalarType dtype);
// A fused pointwise kernel: n_ops ops over numel elements, one HBM round trip.
void record_fused(c10::DeviceIndex d, c10::ScalarType dtype, int64_t numel, int64_t n_ops,
                  int64_t bytes_in, int64_t bytes_out);

// Adaptive Eager Execution (fusion.cpp): pointwise ops, last-dim reductions and last-dim
// concatenations wait in a per-device window and run as one chunked kernel, bit-identical
// to eager.
namespace fusion {
struct Op {
  std::optional<c10::OperatorHandle> kernel;  // the out= overload, or the in-place op
  std::function<void()> run;          // the op alone, when the window holds only it
  std::vector<c10::IValue> args;      // device tensors stay device tensors here
  std::vector<at::Tensor> outs;       // the fresh output (out= ops)
  bool use_out = false;
  int self = -1;                      // the argument an in-place op writes
  int64_t numel = 0;
  std::vector<int64_t> shape;         // iteration shape: the output's, a reduction's input's
  // pure: every operand contiguous and of `shape` (chunks of the flat range are independent).
  // row: operands broadcast to `shape`, or it reduces or concatenates along the last dim
  // (blocks of whole rows are independent). exact: each element's value does not depend on
  // which of ATen's vector or scalar loops computes it; split_free: nor do its bits where NaNs
  // are involved (which NaN a result is).
  bool pure = false, row = false, exact = false, split_free = false;
  // A `_foreach_` op: one pure op per list index (then `shape` holds their element counts).
  std::vector<Op> parts;
  const char* name = nullptr;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<at::Tensor> shape_tensors;  // for the cost record
  int64_t bytes_in = 0, bytes_out = 0;
};
struct Stats {
  int64_t ops, kernels, fused_kernels, fused_ops, one_pass_ops;
};
bool enabled();
void set_enabled(bool on);
void count_launch();  // a launch that bypasses the window: one op, one kernel
void append(c10::DeviceIndex d, int64_t stream, Op op);
void flush(c10::DeviceIndex d);
void flush_all();
bool holding(c10::DeviceIndex d);  // ops are waiting in the device's window
// Can fp32 exp run in one-pass runs (fused_exact.cpp), bit for bit as ATen's kernel computes it?
bool exp_joins_runs();
Stats stats(bool reset);
}  // namespace fusion

namespace launch {
// Queues the op on `stack` to run asynchronously; false: it must run now.
// A signature seen for the first time fills `learning`; the caller runs the op now and then
// calls confirm() with the results on the stack.
bool try_launch(const c10::OperatorHandle& op, std::vector<c10::IValue>* stack,
                std::shared_ptr<void>* learning);
void confirm(std::shared_ptr<void>& learning, const c10::OperatorHandle& op,
             const std::vector<c10::IValue>& stack);
}  // namespace launch

// The device's work queues (queue.cpp): launched work runs in order on the device's executor
// thread; host reads wait for it.
namespace queue {
struct Site {  // where Python launched a piece of work: a few frames, resolved on error only
  const void* code[4] = {};
  int lasti[4] = {};
  int n = 0;
};
bool asynchronous();  // false under NEURON_LAUNCH_BLOCKING=1 or inside a synchronous region
bool blocking();
void set_blocking(bool on);
void enter_sync();  // host code reading device memory directly (compiled graphs, NKI)
void exit_sync();
void set_site_hooks(Site (*capture)(), std::string (*describe)(const Site&));
// launch() first closes the device's fusion window; launch_now() is the window's own.
// bytes: the memory the work reads and writes. A host waiting for the device spins while
// small work runs and sleeps while large work runs (spinning would take a core from its
// parallel loop).
uint64_t launch(c10::DeviceIndex d, int64_t stream, const char* op, std::function<void()> run,
                int64_t bytes = 0);
uint64_t launch_now(c10::DeviceIndex d, int64_t stream, const char* op, std::function<void()> run,
                    int64_t bytes = 0);
// Work of a few microseconds: run at once on the calling thread if the device is idle
// (false, and nothing run, if it is busy). Errors are kept for the next wait, as queued ones.
bool run_inline(c10::DeviceIndex d, int64_t stream, const char* op, c10::function_ref<void()> run);
void synchronize(c10::DeviceIndex d);
void synchronize_all();
void synchronize_stream(c10::DeviceIndex d, int64_t stream);
bool query_stream(c10::DeviceIndex d, int64_t stream);
void wait_for(c10::DeviceIndex d, uint64_t seq);
bool query(c10::DeviceIndex d, uint64_t seq);
std::pair<int64_t, int64_t> counts(c10::DeviceIndex d);  // (launched, executed)
// For the allocator: the last launched work if the device is still busy (else 0), whether
// the device has run work `seq`, and a wait that never raises.
uint64_t busy_until(c10::DeviceIndex d);
bool has_run(c10::DeviceIndex d, uint64_t seq);
void wait_idle(c10::DeviceIndex d);
}  // namespace queue

// The stream checker (stream_check.cpp); every hook is a no-op unless enabled().
namespace check {
bool enabled();
void set_enabled(bool on);
void set_where(std::string (*fn)());
void on_op(const char* op, c10::DeviceIndex d, const std::vector<const void*>& reads,
           const std::vector<const void*>& writes);
void on_alloc(const void* p, c10::DeviceIndex d);
void on_free(const void* p);
void on_record_stream(const void* p, c10::DeviceIndex d, int64_t stream);
void on_event_record(const void* ev, c10::DeviceIndex d, int64_t stream);
void on_event_wait(const void* ev, c10::DeviceIndex d, int64_t stream);
void on_event_sync(const void* ev);
void on_event_destroy(const void* ev);
void on_stream_sync(c10::DeviceIndex d, int64_t stream);
void on_device_sync(c10::DeviceIndex d);
}  // namespace check

}  // namespace neuron
