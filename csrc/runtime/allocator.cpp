// The runtime's device memory: a caching allocator over host memory, per device, with the
// modelled HBM capacity enforced and CUDA-compatible statistics.
#include "runtime.h"
#include "history.h"

#include <ATen/core/CachingHostAllocator.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <deque>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace neuron {
namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr int kMaxDevices = 64;
constexpr size_t kAlign = 64;
// Host allocations this large ask the kernel first: overcommit would otherwise hand out
// memory the machine does not have and the OOM killer would end the process later.
constexpr size_t kHostCheckBytes = size_t(256) << 20;

// Rounding keeps sizes to a few classes so freed blocks are reused exactly (no splitting):
// 512 B granules below 1 MiB, then 8 classes per power of two (<= 12.5% slack).
size_t round_size(size_t n) {
  if (n == 0) return 0;
  if (n < (size_t(1) << 20)) return (n + 511) & ~size_t(511);
  size_t p = size_t(1) << (63 - __builtin_clzll(n));
  size_t step = p / 8;
  return (n + step - 1) / step * step;
}

void update(Stat& s, int64_t delta) {
  // Only the aggregate slot is tracked: there is one pool.
  s.current += delta;
  s.peak = std::max(s.peak, s.current);
  if (delta > 0) s.allocated += delta; else s.freed += -delta;
}

// torch.profiler's memory events (profile_memory=True), reported as CUDA's caching
// allocator reports them: the change and the device's totals after it.
void report_usage(void* ptr, int64_t delta, const std::pair<int64_t, int64_t>& totals,
                  c10::DeviceIndex d) {
  c10::reportMemoryUsageToProfiler(ptr, delta, size_t(totals.first), size_t(totals.second),
                                   c10::Device(c10::DeviceType::PrivateUse1, d));
}
std::pair<int64_t, int64_t> totals(const DeviceStats& s) {
  return {s.allocated_bytes[0].current, s.reserved_bytes[0].current};
}

size_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key; size_t value; std::string unit;
  while (f >> key >> value >> unit) {
    if (key == "MemAvailable:") return value * 1024;
  }
  return SIZE_MAX;
}

struct Block {
  void* ptr;
  size_t size;       // rounded size
  size_t requested;
  c10::DeviceIndex device;
};

struct Adopted {
  c10::Storage storage;  // keeps the CPU kernel's buffer alive
  size_t size;
  c10::DeviceIndex device;
};

// An adopted CPU buffer freed while queued work launched before the free may still use it:
// released to the CPU allocator once the device's queue has run past `seq`. (Device blocks
// need no such wait: they are reused only by later work, which the in-order queue runs after
// the work that used them, or by the host after it waited for the queue; see release().)
struct Deferred {
  uint64_t seq;
  size_t size;
  Adopted* adopted;
};

// A block handed out while the memory history records: what a snapshot shows of it.
struct Live {
  size_t size;
  size_t requested;
  int64_t stream;
  history::Context context;
};

struct DeviceState {
  std::unordered_map<size_t, std::vector<void*>> free_blocks;
  std::deque<Deferred> deferred;
  size_t cached_bytes = 0;
  DeviceStats stats;
  int64_t limit = 0;
  // Memory history, touched only while it records: blocks handed out since it started (the
  // allocator keeps no table of live blocks otherwise) and the ring of actions.
  std::unordered_map<void*, Live> live;
  std::vector<history::Entry> ring;
  size_t ring_next = 0;  // oldest entry once the ring is full
};

uint64_t addr_of(const void* p) { return reinterpret_cast<uint64_t>(p); }

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::system_clock::now().time_since_epoch()).count();
}

class NeuronAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex d = current_device();
    return allocate_on(n, d);
  }

  c10::DataPtr allocate_on(size_t n, c10::DeviceIndex d) {
    check_device(d);
    size_t size = round_size(n);
    if (size == 0) return c10::DataPtr(nullptr, nullptr, &free_block, c10::Device(kDevice, d));
    // The stack is taken before the lock: gathering it may wait for the GIL, whose holder
    // may be waiting for this lock.
    history::Context ctx;
    const uint8_t mode = mode_.load(std::memory_order_relaxed);
    if (C10_UNLIKELY(mode & kGatherAlloc)) ctx = gather(mode);
    void* ptr = nullptr;
    std::pair<int64_t, int64_t> after;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& st = state_[d];
      reclaim_locked(st, d);
      auto it = st.free_blocks.find(size);
      bool fresh = false;
      if (it != st.free_blocks.end() && !it->second.empty()) {
        ptr = it->second.back();
        it->second.pop_back();
        st.cached_bytes -= size;
      } else {
        ptr = fresh_block_locked(st, size, n, d, ctx);
        fresh = true;
      }
      update(st.stats.allocated_bytes[0], size);
      update(st.stats.active_bytes[0], size);
      update(st.stats.requested_bytes[0], n);
      update(st.stats.allocation[0], 1);
      update(st.stats.active[0], 1);
      after = totals(st.stats);
      if (C10_UNLIKELY(hist_.enabled)) note_alloc_locked(st, d, ptr, size, n, fresh, ctx);
    }
    report_usage(ptr, int64_t(size), after, d);
    auto* b = new Block{ptr, size, n, d};
    if (check::enabled()) check::on_alloc(ptr, d);
    return c10::DataPtr(ptr, b, &free_block, c10::Device(kDevice, d));
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dst, const void* src, std::size_t count) const override {
    std::memcpy(dst, src, count);
  }

  bool initialized() override { return true; }

  void emptyCache(c10::MempoolId_t) override {
    std::lock_guard<std::mutex> g(mu_);
    for (int d = 0; d < kMaxDevices; ++d) {
      reclaim_locked(state_[d], static_cast<c10::DeviceIndex>(d));
      release_cache_locked(state_[d], static_cast<c10::DeviceIndex>(d));
    }
  }

  void recordStream(const c10::DataPtr&, c10::Stream) override {
    // One in-order executor runs all of a device's streams, and a freed block waits for the
    // work launched before its free (see Deferred): a block is never reused while in flight.
  }

  DeviceStats getDeviceStats(c10::DeviceIndex d) override {
    // Tensors the program dropped may still be held by the fusion window: let it go first,
    // so the numbers say what the program holds.
    queue::close_window(d);
    std::lock_guard<std::mutex> g(mu_);
    return state_[d].stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex d) override {
    std::lock_guard<std::mutex> g(mu_);
    auto& s = state_[d].stats;
    for (Stat* stat : {&s.allocation[0], &s.segment[0], &s.active[0], &s.allocated_bytes[0],
                       &s.reserved_bytes[0], &s.active_bytes[0], &s.requested_bytes[0]}) {
      stat->allocated = 0;
      stat->freed = 0;
    }
    s.num_alloc_retries = 0;
    s.num_ooms = 0;
    s.num_device_alloc = 0;
    s.num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex d) override {
    std::lock_guard<std::mutex> g(mu_);
    auto& s = state_[d].stats;
    for (Stat* stat : {&s.allocation[0], &s.segment[0], &s.active[0], &s.allocated_bytes[0],
                       &s.reserved_bytes[0], &s.active_bytes[0], &s.requested_bytes[0]}) {
      stat->peak = stat->current;
    }
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex d) override {
    queue::close_window(d);
    std::lock_guard<std::mutex> g(mu_);
    auto& st = state_[d];
    int64_t used = st.stats.reserved_bytes[0].current;
    return {size_t(std::max<int64_t>(0, st.limit - used)), size_t(st.limit)};
  }

  c10::DataPtr adopt(c10::Storage cpu, c10::DeviceIndex d) {
    size_t size = cpu.nbytes();
    void* ptr = cpu.mutable_data();
    history::Context ctx;
    const uint8_t mode = mode_.load(std::memory_order_relaxed);
    if (C10_UNLIKELY(mode & kGatherAlloc)) ctx = gather(mode);
    std::pair<int64_t, int64_t> after;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& st = state_[d];
      if (st.stats.reserved_bytes[0].current + int64_t(size) > st.limit) release_cache_locked(st, d);
      if (st.stats.reserved_bytes[0].current + int64_t(size) > st.limit) {
        st.stats.num_ooms++;
        raise_oom_locked(st, size, d, "", ctx);
      }
      update(st.stats.reserved_bytes[0], size);
      update(st.stats.segment[0], 1);
      update(st.stats.allocated_bytes[0], size);
      update(st.stats.active_bytes[0], size);
      update(st.stats.requested_bytes[0], size);
      update(st.stats.allocation[0], 1);
      update(st.stats.active[0], 1);
      after = totals(st.stats);
      // The adopted buffer is a segment of its own, as a fresh block is. An empty one (a CPU
      // kernel's empty output) is no memory: the viewer is not shown it, as CUDA's is not.
      if (C10_UNLIKELY(hist_.enabled) && size) note_alloc_locked(st, d, ptr, size, size, true, ctx);
    }
    report_usage(ptr, int64_t(size), after, d);
    auto* a = new Adopted{std::move(cpu), size, d};
    if (check::enabled()) check::on_alloc(ptr, d);
    return c10::DataPtr(ptr, a, &free_adopted, c10::Device(kDevice, d));
  }

  // The CPU storage a device buffer adopted, or an empty one.
  static c10::Storage adopted(const c10::DataPtr& p) {
    if (p.get_deleter() != &free_adopted) return {};
    return static_cast<Adopted*>(p.get_context())->storage;
  }

  void set_limit(c10::DeviceIndex d, int64_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    state_[d].limit = bytes;
  }

  void set_gather(history::Context (*fn)(bool)) { gather_.store(fn); }

  void record_history(const history::Options& o) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& st : state_) {
      if (!o.enabled) {
        // Off forgets everything: frees are no longer seen, so the live table would go stale.
        st.live.clear();
        st.ring.clear();
        st.ring_next = 0;
        continue;
      }
      if (o.clear || !o.trace || o.max_entries == 0) {
        st.ring.clear();
        st.ring_next = 0;
      } else {
        // A new max_entries keeps the newest entries, oldest first.
        auto v = ordered(st);
        if (v.size() > o.max_entries) v.erase(v.begin(), v.end() - o.max_entries);
        st.ring = std::move(v);
        st.ring_next = 0;
      }
    }
    hist_ = o;
    uint8_t mode = 0;
    if (o.enabled) {
      mode = kOn | (o.stack_blocks || o.stack_allocs ? kGatherAlloc : 0) |
             (o.stack_frees ? kGatherFree : 0) | (o.cpp ? kCpp : 0);
    }
    mode_.store(mode);
  }

  history::Snapshot snapshot() {
    // Tensors the program dropped may still be held by the fusion window: let them go first,
    // so the snapshot shows what the program holds (as getDeviceStats does).
    queue::close_all_windows();
    history::Snapshot s;
    std::lock_guard<std::mutex> g(mu_);
    const int n = device_count();
    s.traces.resize(n);
    for (int i = 0; i < n; ++i) {
      const auto d = static_cast<c10::DeviceIndex>(i);
      auto& st = state_[i];
      for (auto& kv : st.live) {
        s.blocks.push_back({d, addr_of(kv.first), int64_t(kv.second.size),
                            int64_t(kv.second.requested), "active_allocated", kv.second.stream,
                            kv.second.context});
      }
      for (auto& f : st.deferred) {
        if (!f.size) continue;
        s.blocks.push_back({d, addr_of(f.adopted->storage.data()), int64_t(f.size),
                            int64_t(f.size), "active_pending_free", 0, nullptr});
      }
      for (auto& kv : st.free_blocks) {
        for (void* p : kv.second) {
          s.blocks.push_back({d, addr_of(p), int64_t(kv.first), 0, "inactive", 0, nullptr});
        }
      }
      s.traces[i] = ordered(st);
    }
    std::sort(s.blocks.begin(), s.blocks.end(), [](const history::Block& a, const history::Block& b) {
      return std::make_pair(a.device, a.addr) < std::make_pair(b.device, b.addr);
    });
    return s;
  }

 private:
  static void free_block(void* ctx) {
    if (!ctx) return;
    auto* b = static_cast<Block*>(ctx);
    if (check::enabled()) check::on_free(b->ptr);
    instance().release(b);
    delete b;
  }

  static void free_adopted(void* ctx) {
    auto* a = static_cast<Adopted*>(ctx);
    if (check::enabled()) check::on_free(a->storage.data());
    auto& self = instance();
    history::Context stack;
    const uint8_t mode = self.mode_.load(std::memory_order_relaxed);
    if (C10_UNLIKELY(mode & kGatherFree)) stack = self.gather(mode);
    uint64_t seq = queue::busy_until(a->device);
    // `a` may be reclaimed by another thread once deferred and unlocked: keep what the report needs.
    void* ptr = a->storage.mutable_data();
    const int64_t size = int64_t(a->size);
    const c10::DeviceIndex d = a->device;
    std::pair<int64_t, int64_t> after;
    {
      std::lock_guard<std::mutex> g(self.mu_);
      auto& st = self.state_[a->device];
      if (seq) {
        // Counted as freed now (as CUDA's allocator does); released once the queue passes.
        st.deferred.push_back({seq, a->size, a});
        update(st.stats.allocated_bytes[0], -int64_t(a->size));
        update(st.stats.active_bytes[0], -int64_t(a->size));
        update(st.stats.requested_bytes[0], -int64_t(a->size));
        update(st.stats.allocation[0], -1);
        update(st.stats.active[0], -1);
      } else {
        update(st.stats.reserved_bytes[0], -int64_t(a->size));
        update(st.stats.segment[0], -1);
        update(st.stats.allocated_bytes[0], -int64_t(a->size));
        update(st.stats.active_bytes[0], -int64_t(a->size));
        update(st.stats.requested_bytes[0], -int64_t(a->size));
        update(st.stats.allocation[0], -1);
        update(st.stats.active[0], -1);
      }
      after = totals(st.stats);
      if (C10_UNLIKELY(self.hist_.enabled) && size) {
        // Deferred: completed when reclaim_locked releases it.
        self.note_free_locked(st, d, ptr, size, stack, /*completed=*/!seq);
        if (!seq) self.push_locked(st, {"segment_free", d, addr_of(ptr), size, 0, now_us(), 0, nullptr});
      }
    }
    report_usage(ptr, -size, after, d);
    if (!seq) delete a;
  }

  // Stream-ordered reuse, as CUDA's caching allocator does: a block freed while queued work
  // still uses it goes straight back to the cache, because whoever gets it next writes it
  // either from work launched later (run after that work by the in-order queue) or from the
  // host after waiting for the queue (synchronous ops, copies to the host, direct access).
  void release(Block* b) {
    history::Context stack;
    const uint8_t mode = mode_.load(std::memory_order_relaxed);
    if (C10_UNLIKELY(mode & kGatherFree)) stack = gather(mode);
    std::pair<int64_t, int64_t> after;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& st = state_[b->device];
      st.free_blocks[b->size].push_back(b->ptr);
      st.cached_bytes += b->size;
      update(st.stats.allocated_bytes[0], -int64_t(b->size));
      update(st.stats.active_bytes[0], -int64_t(b->size));
      update(st.stats.requested_bytes[0], -int64_t(b->requested));
      update(st.stats.allocation[0], -1);
      update(st.stats.active[0], -1);
      after = totals(st.stats);
      if (C10_UNLIKELY(hist_.enabled)) {
        note_free_locked(st, b->device, b->ptr, int64_t(b->requested), stack, /*completed=*/true);
      }
    }
    report_usage(b->ptr, -int64_t(b->size), after, b->device);
  }

  // Adopted buffers whose last users have run are released (in free order).
  void reclaim_locked(DeviceState& st, c10::DeviceIndex d) {
    while (!st.deferred.empty() && queue::has_run(d, st.deferred.front().seq)) {
      auto f = st.deferred.front();
      st.deferred.pop_front();
      update(st.stats.reserved_bytes[0], -int64_t(f.size));
      update(st.stats.segment[0], -1);
      if (C10_UNLIKELY(hist_.enabled) && f.size) {
        const uint64_t a = addr_of(f.adopted->storage.data());
        push_locked(st, {"free_completed", d, a, int64_t(f.size), 0, now_us(), 0, nullptr});
        push_locked(st, {"segment_free", d, a, int64_t(f.size), 0, now_us(), 0, nullptr});
      }
      delete f.adopted;
    }
  }

  void* fresh_block_locked(DeviceState& st, size_t size, size_t requested, c10::DeviceIndex d,
                           const history::Context& ctx) {
    if (st.stats.reserved_bytes[0].current + int64_t(size) > st.limit) {
      st.stats.num_alloc_retries++;
      if (!st.deferred.empty()) {
        // Memory freed behind queued work: let the device catch up, then reuse it.
        queue::wait_idle(d);
        reclaim_locked(st, d);
      }
      release_cache_locked(st, d);
    }
    if (st.stats.reserved_bytes[0].current + int64_t(size) > st.limit) {
      st.stats.num_ooms++;
      raise_oom_locked(st, requested, d, "", ctx);
    }
    if (size >= kHostCheckBytes && size > host_available_bytes()) {
      release_cache_locked(st, d);
      if (size > host_available_bytes()) {
        st.stats.num_ooms++;
        raise_oom_locked(st, requested, d, " The host running the virtual device has less memory available than requested.", ctx);
      }
    }
    void* ptr = std::aligned_alloc(kAlign, (size + kAlign - 1) / kAlign * kAlign);
    if (!ptr) {
      release_cache_locked(st, d);
      ptr = std::aligned_alloc(kAlign, (size + kAlign - 1) / kAlign * kAlign);
      if (!ptr) {
        st.stats.num_ooms++;
        raise_oom_locked(st, requested, d, " Host allocation failed.", ctx);
      }
    }
    st.stats.num_device_alloc++;
    update(st.stats.reserved_bytes[0], size);
    update(st.stats.segment[0], 1);
    return ptr;
  }

  void release_cache_locked(DeviceState& st, c10::DeviceIndex d) {
    // Cached blocks may still be read or written by queued work: returning them to the
    // host's allocator must wait for the queue.
    if (!st.free_blocks.empty()) queue::wait_idle(d);
    for (auto& kv : st.free_blocks) {
      for (void* p : kv.second) {
        if (C10_UNLIKELY(hist_.enabled)) {
          push_locked(st, {"segment_free", d, addr_of(p), int64_t(kv.first), 0, now_us(), 0, nullptr});
        }
        std::free(p);
        st.stats.num_device_free++;
        update(st.stats.reserved_bytes[0], -int64_t(kv.first));
        update(st.stats.segment[0], -1);
      }
    }
    st.free_blocks.clear();
    st.cached_bytes = 0;
  }

  static std::string fmt_bytes(int64_t b) {
    std::ostringstream o;
    o.precision(2);
    o << std::fixed;
    if (b >= (int64_t(1) << 30)) o << double(b) / double(1 << 30) << " GiB";
    else if (b >= (1 << 20)) o << double(b) / double(1 << 20) << " MiB";
    else if (b >= (1 << 10)) o << double(b) / double(1 << 10) << " KiB";
    else o << b << " bytes";
    return o.str();
  }

  std::string summary_locked(DeviceState& st, c10::DeviceIndex d) {
    auto& s = st.stats;
    std::ostringstream o;
    o << "neuron:" << int(d) << " memory: " << fmt_bytes(s.allocated_bytes[0].current)
      << " allocated by PyTorch (peak " << fmt_bytes(s.allocated_bytes[0].peak) << "), "
      << fmt_bytes(s.reserved_bytes[0].current) << " reserved (peak "
      << fmt_bytes(s.reserved_bytes[0].peak) << "), " << fmt_bytes(st.cached_bytes)
      << " cached free, modelled HBM capacity " << fmt_bytes(st.limit) << ", "
      << s.allocation[0].current << " live allocations, " << s.num_ooms << " OOMs.";
    return o.str();
  }

  [[noreturn]] void raise_oom_locked(DeviceState& st, size_t requested, c10::DeviceIndex d,
                                     const char* extra, const history::Context& ctx) {
    int64_t free_bytes = std::max<int64_t>(0, st.limit - st.stats.reserved_bytes[0].current);
    if (C10_UNLIKELY(hist_.enabled)) {
      push_locked(st, {"oom", d, 0, int64_t(requested), current_stream_id(d), now_us(), free_bytes,
                       hist_.stack_allocs ? ctx : nullptr});
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false,
        "Neuron out of memory. Tried to allocate ", fmt_bytes(requested), " on neuron:", int(d),
        ". The virtual NeuronCore has a modelled HBM capacity of ", fmt_bytes(st.limit), " of which ",
        fmt_bytes(free_bytes), " is free.", extra, " ", summary_locked(st, d),
        " See torch.neuron.memory_summary() for details; torch.neuron.empty_cache() releases "
        "cached blocks.");
  }

 public:
  static NeuronAllocator& instance();

 private:
  // Memory history: what the hot paths must do, read without the lock; 0 while off.
  static constexpr uint8_t kOn = 1, kGatherAlloc = 2, kGatherFree = 4, kCpp = 8;

  history::Context gather(uint8_t mode) {
    auto* fn = gather_.load();
    return fn ? fn((mode & kCpp) != 0) : nullptr;
  }

  void push_locked(DeviceState& st, history::Entry e) {
    if (!hist_.trace || hist_.max_entries == 0) return;
    for (const auto& skip : hist_.skip) {
      if (skip == e.action) return;
    }
    if (st.ring.size() < hist_.max_entries) {
      st.ring.push_back(std::move(e));
    } else {
      st.ring[st.ring_next] = std::move(e);
      st.ring_next = (st.ring_next + 1) % hist_.max_entries;
    }
  }

  static std::vector<history::Entry> ordered(const DeviceState& st) {
    std::vector<history::Entry> v(st.ring.begin() + st.ring_next, st.ring.end());
    v.insert(v.end(), st.ring.begin(), st.ring.begin() + st.ring_next);
    return v;
  }

  // Sizes in alloc and free entries are the requested bytes (CUDA's, which the viewer plots);
  // segment entries carry the rounded block.
  void note_alloc_locked(DeviceState& st, c10::DeviceIndex d, void* ptr, size_t size,
                         size_t requested, bool fresh, const history::Context& ctx) {
    const int64_t stream = current_stream_id(d);
    const history::Context entry_ctx = hist_.stack_allocs ? ctx : history::Context();
    const int64_t t = now_us();
    if (fresh) push_locked(st, {"segment_alloc", d, addr_of(ptr), int64_t(size), stream, t, 0, entry_ctx});
    push_locked(st, {"alloc", d, addr_of(ptr), int64_t(requested), stream, t, 0, entry_ctx});
    st.live[ptr] = Live{size, requested, stream, hist_.stack_blocks ? ctx : nullptr};
  }

  void note_free_locked(DeviceState& st, c10::DeviceIndex d, void* ptr, int64_t requested,
                        const history::Context& ctx, bool completed) {
    auto it = st.live.find(ptr);
    // A block handed out before recording started is not in the table: its free still counts.
    const int64_t stream = it != st.live.end() ? it->second.stream : current_stream_id(d);
    if (it != st.live.end()) st.live.erase(it);
    const history::Context entry_ctx = hist_.stack_frees ? ctx : history::Context();
    const int64_t t = now_us();
    push_locked(st, {"free_requested", d, addr_of(ptr), requested, stream, t, 0, entry_ctx});
    if (completed) push_locked(st, {"free_completed", d, addr_of(ptr), requested, stream, t, 0, entry_ctx});
  }

  std::mutex mu_;
  std::array<DeviceState, kMaxDevices> state_;
  std::atomic<uint8_t> mode_{0};
  history::Options hist_;  // under mu_
  std::atomic<history::Context (*)(bool)> gather_{nullptr};
};

NeuronAllocator g_allocator;
NeuronAllocator& NeuronAllocator::instance() { return g_allocator; }

// Pinned host memory: ordinary host memory whose pointers are remembered, so
// `is_pinned()` holds and DataLoader's pin_memory path works. It is the device's host
// allocator too (torch.accelerator.empty_host_cache and host memory stats reach it as
// at::HostAllocator): nothing is cached, so there is nothing to empty or to wait for.
class PinnedAllocator final : public at::HostAllocator {
 public:
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}

  c10::DataPtr allocate(size_t n) override {
    void* p = n ? std::aligned_alloc(kAlign, (n + kAlign - 1) / kAlign * kAlign) : nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, !n || p, "pinned host allocation of ", n, " bytes failed");
    if (p) {
      std::lock_guard<std::mutex> g(mu_);
      live_.insert(p);
    }
    return c10::DataPtr(p, p, &release, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dst, const void* src, std::size_t count) const override {
    std::memcpy(dst, src, count);
  }
  bool contains(const void* p) {
    std::lock_guard<std::mutex> g(mu_);
    return live_.count(const_cast<void*>(p)) > 0;
  }
  static void release(void* p);

 private:
  std::mutex mu_;
  std::unordered_set<void*> live_;
  friend void erase_pinned(void*);
};

PinnedAllocator g_pinned;
void PinnedAllocator::release(void* p) {
  if (!p) return;
  {
    std::lock_guard<std::mutex> g(g_pinned.mu_);
    g_pinned.live_.erase(p);
  }
  std::free(p);
}

}  // namespace

c10::DeviceAllocator* allocator() { return &g_allocator; }
c10::DataPtr allocate_on(size_t n, c10::DeviceIndex d) { return g_allocator.allocate_on(n, d); }
void set_memory_limit(c10::DeviceIndex d, int64_t bytes) { g_allocator.set_limit(d, bytes); }
c10::DataPtr adopt(c10::Storage cpu_storage, c10::DeviceIndex d) {
  return g_allocator.adopt(std::move(cpu_storage), d);
}
c10::Storage adopted_storage(const c10::DataPtr& p) { return NeuronAllocator::adopted(p); }
c10::Allocator* pinned_allocator() { return &g_pinned; }
bool is_pinned(const void* p) { return g_pinned.contains(p); }

namespace history {
void set_gather(Context (*gather)(bool cpp)) { g_allocator.set_gather(gather); }
void record(const Options& o) { g_allocator.record_history(o); }
Snapshot snapshot() { return g_allocator.snapshot(); }
}  // namespace history

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);
REGISTER_HOST_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_pinned);

}  // namespace neuron
