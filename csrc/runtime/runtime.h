// The runtime: the device table, the caching allocator over host memory, generators, the
// device's work queues and the stream checker. It depends on nothing else in csrc/.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/FunctionRef.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>

#include "record.h"

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
// The CPU storage behind an adopted device buffer (empty if it is not one).
c10::Storage adopted_storage(const c10::DataPtr& p);
c10::Allocator* pinned_allocator();
bool is_pinned(const void* p);


// Generators.
const at::Generator& default_generator(c10::DeviceIndex d);
at::Generator new_generator(c10::DeviceIndex d);

// Device memory is host memory (alias.cpp): a zero-copy CPU view of a device tensor; a
// device tensor over the memory of a fresh CPU tensor; a device tensor shaped like `like`
// over `storage`.
at::Tensor cpu_alias(const at::Tensor& t);
at::Tensor adopt_tensor(const at::Tensor& cpu, c10::DeviceIndex d);
at::Tensor wrap_storage(c10::Storage storage, const at::Tensor& like);

int64_t current_stream_id(c10::DeviceIndex d);

// Graph capture (torch.accelerator.Graph; the recording itself is Python's): while a capture
// is open, a host synchronisation with the device raises, as CUDA's do during stream capture.
void set_capturing(int device, int64_t stream, bool on);
bool is_capturing(int device, int64_t stream);
void check_not_capturing(const char* what);

// The modelled timeline's epochs: work on different streams of one epoch overlaps; a cross-
// stream wait or a host synchronization starts a new epoch. Epochs stay 0 until a device
// uses a second stream, so single-stream programs aggregate into one record per op shape.
int64_t timeline_epoch(c10::DeviceIndex d, int64_t stream);
void timeline_barrier(c10::DeviceIndex d);

// The device's work queues (queue.cpp): launched work runs in order on the device's executor
// thread; host reads wait for it.
namespace queue {
struct Site {  // where Python launched a piece of work: a few frames, resolved on error only
  const void* code[4] = {};
  int lasti[4] = {};
  int n = 0;
};
bool asynchronous();  // false under NEURON_LAUNCH_BLOCKING=1 or inside a synchronous region
// The intra-op thread count queued work runs with, fixed at launch: the device's own count if
// set (set_device_threads(n > 0)), else the launching thread's torch.get_num_threads(); work
// of a compiled graph under 2 MiB (`bytes`, when known) leaves the launching thread a core
// (queue.cpp). Anything that reproduces a kernel's per-thread split (fusion/) must use it too.
int launch_threads(int64_t bytes = -1);
int device_threads();  // 0: not set
void set_device_threads(int n);
// A compiled graph's call runs between enter_compiled() and exit_compiled(depth it returned).
int enter_compiled();
void exit_compiled(int depth);
// Device work run on the calling thread (synchronous ops, blocking mode) runs with the
// device's count too, for the same results as when queued.
struct HostThreads {
  explicit HostThreads(int64_t bytes = -1);
  ~HostThreads();
  HostThreads(const HostThreads&) = delete;
  HostThreads& operator=(const HostThreads&) = delete;
  int omp = 0, mkl = -1;
};
bool blocking();
void set_blocking(bool on);
void enter_sync();  // host code reading device memory directly (compiled graphs, NKI)
void exit_sync();
void set_site_hooks(Site (*capture)(), std::string (*describe)(const Site&));
// The runtime knows nothing of the Adaptive Eager window above it (fusion/): the window
// registers how to close it, and the runtime closes it before any work or wait that must see
// the window's results (a launch, a synchronization, the allocator reusing memory).
void set_window_closer(void (*flush)(c10::DeviceIndex), void (*flush_all)());
void close_window(c10::DeviceIndex d);
void close_all_windows();
// launch() first closes the device's fusion window; launch_now() is the window's own.
// bytes: the memory the work reads and writes. A host waiting for the device spins while
// small work runs and sleeps while large work runs (spinning would take a core from its
// parallel loop).
// threads: the count the work runs with (0: launch_threads(bytes)).
uint64_t launch(c10::DeviceIndex d, int64_t stream, const char* op, std::function<void()> run,
                int64_t bytes = 0, int threads = 0);
uint64_t launch_now(c10::DeviceIndex d, int64_t stream, const char* op, std::function<void()> run,
                    int64_t bytes = 0);
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
