// The stream checker: with it on, every device op is checked for a buffer written on one
// stream and read or written on another with nothing ordering the two (an event, a
// wait_stream, a synchronize), as on the chip, where streams are independent queues.
//
// Ordering is tracked with vector clocks: each stream counts its ops; recording an event
// snapshots the stream's clock, waiting on it merges the snapshot, and a host
// synchronization merges into the host's clock, which every later launch inherits.
#include "runtime.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace neuron::check {
namespace {

using Key = std::pair<int, int64_t>;  // (device, stream id)
using Clock = std::map<Key, uint64_t>;

struct Access {
  Key stream;
  uint64_t tick;
  std::string op;
  std::string where;
};

struct Buffer {
  Key alloc_stream{-1, 0};
  std::vector<Key> recorded;         // record_stream() calls since allocation
  bool has_write = false;
  Access write;
  std::vector<Access> reads;         // since the last write, at most one per stream
  std::vector<Access> before_reuse;  // unordered accesses of a freed block's previous life
};

std::atomic<bool> g_enabled{false};
std::mutex g_mu;
std::map<Key, Clock> g_clocks;
Clock g_host;
std::unordered_map<const void*, Clock> g_events;
std::unordered_map<const void*, Buffer> g_buffers;
std::string (*g_where)() = nullptr;

void merge(Clock& into, const Clock& from) {
  for (const auto& [k, v] : from) {
    auto& slot = into[k];
    if (v > slot) slot = v;
  }
}

bool ordered(const Access& a, const Key& s) {
  if (a.stream == s) return true;
  auto it = g_clocks.find(s);
  if (it == g_clocks.end()) return false;
  auto jt = it->second.find(a.stream);
  return jt != it->second.end() && jt->second >= a.tick;
}

std::string describe(const Key& k) {
  std::ostringstream o;
  o << "stream " << k.second << " of neuron:" << k.first;
  return o.str();
}

[[noreturn]] void report(const char* kind, const Access& before, const Access& now,
                         const void* ptr, const char* hint) {
  std::ostringstream o;
  o << "neuron stream checker: " << kind << " on the device buffer at " << ptr << ": "
    << now.op << " on " << describe(now.stream) << " (" << now.where << ") "
    << (std::string(kind).find("read") == 0 ? "reads" : "writes") << " it, but " << before.op
    << " on " << describe(before.stream) << " (" << before.where << ") accessed it with "
    << "nothing ordering the two. " << hint;
  TORCH_CHECK(false, o.str());
}

Key stream_key(c10::DeviceIndex d) {
  return {int(d), current_stream_id(d)};
}

}  // namespace

bool enabled() { return g_enabled.load(std::memory_order_relaxed); }

void set_enabled(bool on) {
  std::lock_guard<std::mutex> g(g_mu);
  g_enabled = on;
  g_clocks.clear();
  g_host.clear();
  g_events.clear();
  g_buffers.clear();
}

void set_where(std::string (*fn)()) { g_where = fn; }

void on_op(const char* op, c10::DeviceIndex d, const std::vector<const void*>& reads,
           const std::vector<const void*>& writes) {
  std::string where = g_where ? g_where() : std::string("?");
  std::lock_guard<std::mutex> g(g_mu);
  Key s = stream_key(d);
  Clock& clock = g_clocks[s];
  merge(clock, g_host);
  Access now{s, clock[s] + 1, op, where};
  const char* sync_hint =
      "Order them with an event (Event.record / Stream.wait_event), "
      "Stream.wait_stream, or a synchronize.";
  for (const void* p : reads) {
    auto it = g_buffers.find(p);
    if (it == g_buffers.end()) continue;
    auto& b = it->second;
    if (b.has_write && !ordered(b.write, s)) report("read after write", b.write, now, p, sync_hint);
  }
  for (const void* p : writes) {
    auto it = g_buffers.find(p);
    if (it == g_buffers.end()) continue;
    auto& b = it->second;
    for (const auto& a : b.before_reuse) {
      if (!ordered(a, s)) {
        report("write after free", a, now, p,
               "The buffer was freed and handed out again while that stream could still use "
               "it: call tensor.record_stream(stream) for tensors used on a side stream.");
      }
    }
    if (b.has_write && !ordered(b.write, s)) report("write after write", b.write, now, p, sync_hint);
    for (const auto& r : b.reads) {
      if (!ordered(r, s)) report("write after read", r, now, p, sync_hint);
    }
  }
  clock[s] = now.tick;
  for (const void* p : reads) {
    auto& b = g_buffers[p];
    bool found = false;
    for (auto& r : b.reads) {
      if (r.stream == s) { r = now; found = true; }
    }
    if (!found) b.reads.push_back(now);
  }
  for (const void* p : writes) {
    auto& b = g_buffers[p];
    b.has_write = true;
    b.write = now;
    b.reads.clear();
    b.before_reuse.clear();
  }
}

void on_alloc(const void* p, c10::DeviceIndex d) {
  std::lock_guard<std::mutex> g(g_mu);
  auto& b = g_buffers[p];
  std::vector<Access> pending = std::move(b.before_reuse);
  b = Buffer();
  b.alloc_stream = stream_key(d);
  b.before_reuse = std::move(pending);
}

void on_free(const void* p) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_buffers.find(p);
  if (it == g_buffers.end()) return;
  Buffer& b = it->second;
  // As in CUDA's caching allocator, a freed block goes back to its allocation stream, so
  // only accesses from other streams, not covered by record_stream, can race its reuse.
  std::vector<Access> risky;
  auto consider = [&](const Access& a) {
    if (a.stream == b.alloc_stream) return;
    for (const auto& r : b.recorded) if (r == a.stream) return;
    if (ordered(a, b.alloc_stream)) return;
    risky.push_back(a);
  };
  if (b.has_write) consider(b.write);
  for (const auto& r : b.reads) consider(r);
  Buffer next;
  next.before_reuse = std::move(risky);
  b = std::move(next);
}

void on_record_stream(const void* p, c10::DeviceIndex d, int64_t stream) {
  std::lock_guard<std::mutex> g(g_mu);
  g_buffers[p].recorded.push_back({int(d), stream});
}

void on_event_record(const void* ev, c10::DeviceIndex d, int64_t stream) {
  std::lock_guard<std::mutex> g(g_mu);
  g_events[ev] = g_clocks[{int(d), stream}];
}

void on_event_wait(const void* ev, c10::DeviceIndex d, int64_t stream) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_events.find(ev);
  if (it != g_events.end()) merge(g_clocks[{int(d), stream}], it->second);
}

void on_event_sync(const void* ev) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_events.find(ev);
  if (it != g_events.end()) merge(g_host, it->second);
}

void on_event_destroy(const void* ev) {
  std::lock_guard<std::mutex> g(g_mu);
  g_events.erase(ev);
}

void on_stream_sync(c10::DeviceIndex d, int64_t stream) {
  std::lock_guard<std::mutex> g(g_mu);
  merge(g_host, g_clocks[{int(d), stream}]);
}

void on_device_sync(c10::DeviceIndex d) {
  std::lock_guard<std::mutex> g(g_mu);
  for (const auto& [k, c] : g_clocks) {
    if (d < 0 || k.first == int(d)) merge(g_host, c);
  }
}

}  // namespace neuron::check
