// Device table, device guard (streams and events), hooks and generators: the parts of a
// device PyTorch asks every backend to provide.
#include "runtime.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>

namespace neuron {

namespace {
std::atomic<int> g_device_count{0};
thread_local c10::DeviceIndex t_current_device = 0;
}  // namespace

namespace {
constexpr int kMaxStreamDevices = 64;
thread_local std::array<c10::StreamId, kMaxStreamDevices> t_current_stream{};
}  // namespace

int64_t current_stream_id(c10::DeviceIndex d) { return t_current_stream[d]; }

namespace {
// The streams a torch.accelerator.Graph is capturing on, as (device, stream id); the count
// keeps the check on synchronisations to one load while nothing captures.
std::atomic<int> g_capturing{0};
std::mutex g_capture_mu;
std::vector<std::pair<int, int64_t>> g_capture_streams;
}  // namespace

void set_capturing(int device, int64_t stream, bool on) {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  auto key = std::make_pair(device, stream);
  auto it = std::find(g_capture_streams.begin(), g_capture_streams.end(), key);
  if (on) {
    TORCH_CHECK(it == g_capture_streams.end(), "torch.accelerator.Graph: stream ", stream,
                " of neuron:", device, " is already capturing; end that capture first");
    g_capture_streams.push_back(key);
  } else {
    TORCH_CHECK(it != g_capture_streams.end(), "torch.accelerator.Graph: stream ", stream,
                " of neuron:", device, " is not capturing");
    g_capture_streams.erase(it);
  }
  g_capturing.store(int(g_capture_streams.size()));
}

bool is_capturing(int device, int64_t stream) {
  if (g_capturing.load(std::memory_order_relaxed) == 0) return false;
  std::lock_guard<std::mutex> lock(g_capture_mu);
  return std::find(g_capture_streams.begin(), g_capture_streams.end(),
                   std::make_pair(device, stream)) != g_capture_streams.end();
}

// Checked only by synchronisations (never by a launch): the host would wait for work the
// graph has recorded but not run, so CUDA refuses them while a stream is capturing (its
// default "global" capture mode refuses them from any thread).
void check_not_capturing(const char* what) {
  TORCH_CHECK(g_capturing.load(std::memory_order_relaxed) == 0,
              "operation not permitted when stream is capturing: ", what,
              " waits for the device while a torch.accelerator.Graph is capturing (the captured "
              "work has not run; CUDA raises cudaErrorStreamCaptureUnsupported here). Synchronize "
              "before capture_begin() or after capture_end().");
}

namespace {
std::array<std::atomic<int64_t>, kMaxStreamDevices> g_epoch{};
std::array<std::atomic<bool>, kMaxStreamDevices> g_multi_stream{};
}  // namespace

int64_t timeline_epoch(c10::DeviceIndex d, int64_t stream) {
  if (stream != 0 && !g_multi_stream[d].load(std::memory_order_relaxed)) {
    g_multi_stream[d].store(true);
  }
  return g_multi_stream[d].load(std::memory_order_relaxed) ? g_epoch[d].load() : 0;
}

void timeline_barrier(c10::DeviceIndex d) {
  if (d >= 0 && d < kMaxStreamDevices && g_multi_stream[d].load(std::memory_order_relaxed)) {
    g_epoch[d].fetch_add(1);
  }
}

c10::DeviceIndex device_count() { return static_cast<c10::DeviceIndex>(g_device_count.load()); }
void set_device_count(int n) { g_device_count.store(n); }
c10::DeviceIndex current_device() { return t_current_device; }

void check_device(c10::DeviceIndex d) {
  TORCH_CHECK(d >= 0 && d < device_count(), "Invalid device index neuron:", int(d), ": there ",
              device_count() == 1 ? "is " : "are ", int(device_count()),
              " visible neuron device(s) (logical NeuronCores; see NEURON_RT_VISIBLE_CORES, "
              "NEURON_RT_NUM_CORES and NEURON_LOGICAL_NC_CONFIG)");
}

void set_current_device(c10::DeviceIndex d) {
  check_device(d);
  t_current_device = d;
}

namespace {

// Streams: ids 0 (default) and up per device; their work runs on the device's queue.
std::atomic<c10::StreamId> g_next_stream{1};

struct Event {
  c10::DeviceIndex device = -1;
  bool recorded = false;
  uint64_t seq = 0;  // the queue position of the record
  // Written by the device when it reaches the record; a new cell per record, so a pending
  // record never writes into a later one.
  std::shared_ptr<std::atomic<double>> time_ms;
};

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

struct NeuronGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDevice; }

  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = current_device();
    if (d.index() != old) set_current_device(d.index());
    return c10::Device(kDevice, old);
  }
  c10::Device getDevice() const override { return c10::Device(kDevice, current_device()); }
  void setDevice(c10::Device d) const override { set_current_device(d.index()); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) t_current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override {
    auto idx = d.index() < 0 ? current_device() : d.index();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDevice, idx), t_current_stream[idx]);
  }
  // A stream belongs to one device: `torch.Stream("neuron")` means the current one, as for
  // CUDA (every queue and fusion window is looked up by the stream's device index).
  static c10::Device indexed(c10::Device d) {
    return c10::Device(kDevice, d.index() < 0 ? current_device() : d.index());
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, indexed(d), 0);
  }
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override {
    (void)priority;
    return c10::Stream(c10::Stream::UNSAFE, indexed(d), g_next_stream.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool isHighPriority = false) const override {
    (void)isHighPriority;
    return getNewStream(d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    auto idx = s.device_index();
    auto old = c10::Stream(c10::Stream::UNSAFE, s.device(), t_current_stream[idx]);
    t_current_stream[idx] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }
  // Every dtype allocates on neuron except the quantized ones (eager quantization has no
  // neuron storage: kernels/quantized.py).
  c10::DeviceCapability getDeviceCapability(c10::Device) const override {
    c10::DeviceCapability cap;
    auto& t = cap.capability_data.supported_scalar_types;
    t.has_QInt8 = t.has_QUInt8 = t.has_QInt32 = t.has_QUInt4x2 = t.has_QUInt2x4 = false;
    return cap;
  }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag) const override {
    if (!*event) *event = new Event();
    auto* e = static_cast<Event*>(*event);
    TORCH_CHECK(e->device == -1 || e->device == stream.device_index(), "Event device neuron:",
                int(e->device), " does not match recording stream's device neuron:",
                int(stream.device_index()));
    (void)device_index;
    e->device = stream.device_index();
    e->recorded = true;
    auto cell = std::make_shared<std::atomic<double>>(0.0);
    e->time_ms = cell;
    if (queue::asynchronous()) {
      // The device's clock when the queue reaches the record, as on the chip.
      e->seq = queue::launch(e->device, stream.id(), "neuron::event_record",
                             [cell] { cell->store(now_ms()); });
    } else {
      e->seq = 0;
      cell->store(now_ms());
    }
    if (check::enabled()) check::on_event_record(e, stream.device_index(), stream.id());
  }
  // One in-order executor per device runs every stream: work launched after the wait already
  // follows the recorded work.
  //
  // The stream also gets a marker after the wait, as CUDA's stream holds the wait itself:
  // synchronizing the waiting stream then covers the recorded work, so the event reads as
  // complete afterwards. An event of another device is waited for on the host.
  void block(void* event, const c10::Stream& stream) const override {
    queue::close_window(stream.device_index());  // a cross-stream wait is a fusion boundary
    timeline_barrier(stream.device_index());
    auto* e = static_cast<Event*>(event);
    if (e && e->device >= 0 && !queue::query(e->device, e->seq)) {
      if (e->device == stream.device_index()) {
        queue::launch(stream.device_index(), stream.id(), "neuron::event_wait", [] {});
      } else {
        queue::wait_for(e->device, e->seq);
      }
    }
    if (event && check::enabled()) check::on_event_wait(event, stream.device_index(), stream.id());
  }
  bool queryEvent(void* event) const override {
    if (!event) return true;
    auto* e = static_cast<Event*>(event);
    bool done = e->device < 0 || queue::query(e->device, e->seq);
    if (done && check::enabled()) check::on_event_sync(event);
    return done;
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    if (check::enabled()) check::on_event_destroy(event);
    delete static_cast<Event*>(event);
  }
  bool queryStream(const c10::Stream& s) const override {
    bool done = queue::query_stream(s.device_index(), s.id());
    if (done && check::enabled()) check::on_stream_sync(s.device_index(), s.id());
    return done;
  }
  bool isStreamCapturing(const c10::Stream& s) const override {
    return is_capturing(s.device_index(), s.id());
  }
  void synchronizeStream(const c10::Stream& s) const override {
    check_not_capturing("stream synchronize");
    queue::synchronize_stream(s.device_index(), s.id());
    if (check::enabled()) check::on_stream_sync(s.device_index(), s.id());
  }
  void synchronizeEvent(void* event) const override {
    if (!event) return;
    check_not_capturing("event synchronize");
    auto* e = static_cast<Event*>(event);
    if (e->device >= 0) queue::wait_for(e->device, e->seq);
    if (check::enabled()) check::on_event_sync(event);
  }
  void synchronizeDevice(const c10::DeviceIndex d) const override {
    check_not_capturing("device synchronize (torch.accelerator.synchronize)");
    queue::synchronize(d < 0 ? current_device() : d);
    if (check::enabled()) check::on_device_sync(d);
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a && b && a->recorded && b->recorded,
                "elapsed_time: both events must be recorded before measuring elapsed time");
    TORCH_CHECK(queue::query(a->device, a->seq) && queue::query(b->device, b->seq),
                "elapsed_time: both events must have completed (call event.synchronize() "
                "first); the device has not reached them yet");
    return b->time_ms->load() - a->time_ms->load();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl);


struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex d) const override { set_current_device(d); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = current_device();
    set_current_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override {
    if (d < 0 || d >= device_count()) return current_device();
    return exchangeDevice(d);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex d) const override {
    return default_generator(d);
  }
  at::Generator getNewGenerator(c10::DeviceIndex d) const override { return new_generator(d); }
  at::Device getDeviceFromPtr(void*) const override {
    return at::Device(kDevice, current_device());
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    c10::DeviceIndex d = impl->data_ptr().device().index();
    // Queued work holds this storage's current buffer: let it finish before the move.
    queue::synchronize_all();
    c10::DataPtr fresh = allocate_on(newsize, d);
    size_t keep = std::min(newsize, impl->nbytes());
    if (keep && impl->data()) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new NeuronHooks());
  return true;
}();

}  // namespace

}  // namespace neuron
