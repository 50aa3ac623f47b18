// The op record the cost model reads: counts and bytes per (op, device, dtype, stream,
// timeline epoch, input shapes). Every path that runs device work (the fallback, the launch
// path, fused windows, copies) records here; Python drains it (torch_neuronx.cost_model).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <atomic>
#include <string>
#include <tuple>
#include <vector>

namespace neuron {

// Signature capacity: three 4-D shapes (15 words) and the cost-flags pair.
constexpr int kSigWords = 18;

struct RecordKey {
  const char* name;
  int8_t device;
  int8_t dtype;
  uint8_t len;
  int64_t stream;
  int64_t epoch;  // see timeline_epoch(): work of different epochs never overlaps
  std::array<int64_t, kSigWords> sig;
  bool operator==(const RecordKey& o) const {
    return name == o.name && device == o.device && dtype == o.dtype && len == o.len &&
           stream == o.stream && epoch == o.epoch &&
           std::equal(sig.begin(), sig.begin() + len, o.sig.begin());
  }
};

// Shapes of the first few tensors, each as [ndim, sizes...].
struct Signature {
  RecordKey key{};
  int tensors = 0;
  void add(const at::Tensor& t) {
    if (tensors == 3) return;
    int nd = t.dim();
    if (key.len + 1 + nd > kSigWords - 2) return;
    key.sig[key.len++] = nd;
    for (int i = 0; i < nd; ++i) key.sig[key.len++] = t.size(i);
    ++tensors;
  }
  // Arguments beyond the shapes that change the cost (see cost_flags), as a trailing
  // [-1, flags] pair.
  void flag(int64_t f) {
    if (f < 0 || key.len + 2 > kSigWords) return;
    key.sig[key.len++] = -1;
    key.sig[key.len++] = f;
  }
};

// For attention ops, the arguments their cost depends on beyond the shapes (bit 0: causal,
// bit 1: a mask or bias, bit 2: dropout); -1 for every other op.
int64_t cost_flags(const c10::FunctionSchema& schema, const c10::IValue* args, size_t n);

void commit(Signature& s, const char* name, c10::DeviceIndex d, c10::ScalarType dtype,
            int64_t bytes_in, int64_t bytes_out);
inline int64_t nbytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

void record_op(const char* name, c10::DeviceIndex d, c10::ScalarType dtype,
               c10::ArrayRef<at::Tensor> shape_tensors, int64_t bytes_in, int64_t bytes_out,
               int64_t flags = -1);
// A fused pointwise kernel: n_ops ops over numel elements, one HBM round trip.
void record_fused(c10::DeviceIndex d, c10::ScalarType dtype, int64_t numel, int64_t n_ops,
                  int64_t bytes_in, int64_t bytes_out);
std::vector<std::tuple<std::string, int, int, std::vector<int64_t>, int64_t, int64_t, int64_t,
                       int64_t, int64_t>>
drain_records();

// The once-per-op warning for dtypes Trainium lacks; quiet while tensors print (printing
// computes in float64 internally, not the user).
void warn_if_unportable(const c10::OperatorHandle& op, c10::ScalarType dtype);
void set_quiet(bool on);
// Whether this thread's ops are recorded for the cost model; returns the previous setting.
bool set_recording(bool on);
bool recording();
bool quiet();

// The kernel trace a torch.profiler session with the PrivateUse1 activity fills (defined in
// csrc/profiler, which turns it into Kineto device events). Off, each hook below costs the
// caller one relaxed load.
namespace trace {
extern std::atomic<bool> g_on;
inline bool on() { return g_on.load(std::memory_order_relaxed); }
struct Launch {
  uint64_t id = 0;  // 0: not traced
};
int64_t now_ns();
// From commit(): the op record of the launch that follows (or precedes, for copies).
void on_record(const RecordKey& key, int64_t bytes_in, int64_t bytes_out);
// On the launching thread, as work is queued or run inline; then around its execution.
Launch on_launch(const char* op, c10::DeviceIndex d, int64_t stream);
void on_run(const Launch& l, int64_t start_ns, int64_t end_ns);
}  // namespace trace

}  // namespace neuron
