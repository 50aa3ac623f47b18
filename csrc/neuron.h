// Shared declarations of the neuron runtime glue: the device table, the caching allocator
// over host memory, and the op record the cost model reads.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <string>
#include <vector>

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
