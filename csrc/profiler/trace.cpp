// The runtime's trace hooks (record.h): which launch each op record belongs to, which op (by
// torch.profiler's correlation id) launched each piece of work, and when it ran.
#include "trace.h"

#include <ActivityType.h>
#include <ThreadUtil.h>
#include <c10/util/ApproximateClock.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <iterator>
#include <mutex>

namespace neuron::trace {

std::atomic<bool> g_on{false};

namespace {

std::mutex g_mu;
Buffers g_buf;
std::atomic<uint64_t> g_session{0};
// When each device last finished traced work: a synchronous op waits for it before it runs.
std::array<std::atomic<int64_t>, 64> g_last_end{};
// Launch ids are global; those at or below the session's base belong to an earlier session.
std::atomic<uint64_t> g_next_launch{0};
uint64_t g_base = 0;

struct Corr {
  uint64_t id = 0;
  int64_t start_ns = 0;
};

struct ThreadState {
  uint64_t session = 0;
  std::vector<Corr> stack;
  Corr last;  // the newest op started on this thread: work launched between ops (a fusion
              // window closed by a synchronize) is linked to it
  // This thread's newest records not yet bound to a launch: closing a fusion window records
  // and launches the window's kernel between an op's record and its launch.
  std::vector<int64_t> pending;
  uint64_t unbound_launch = 0;  // ... and last launch with no record (copies record after)
  uint64_t unbound_corr = 0;
  int32_t thread = 0;
};
thread_local ThreadState t;

ThreadState& state() {
  uint64_t s = g_session.load(std::memory_order_relaxed);
  if (t.session != s) {
    t = ThreadState();
    t.session = s;
    t.thread = static_cast<int32_t>(libkineto::systemThreadId());
  }
  return t;
}

Corr current(ThreadState& st) { return st.stack.empty() ? st.last : st.stack.back(); }

// Adaptive Eager records every fused kernel as fused_pointwise, whichever kind it launches.
bool same_kernel(const char* record, const char* launch) {
  if (std::strcmp(record, launch) == 0) return true;
  return std::strncmp(record, "neuron::fused_", 14) == 0 && std::strncmp(launch, "neuron::fused_", 14) == 0;
}

}  // namespace

int64_t now_ns() { return c10::getTime(); }

void start() {
  std::lock_guard<std::mutex> g(g_mu);
  g_buf = Buffers();
  g_base = g_next_launch.load();
  g_session.fetch_add(1);
  g_on.store(true);
}

void stop() { g_on.store(false); }

Buffers take() {
  std::lock_guard<std::mutex> g(g_mu);
  Buffers out;
  std::swap(out, g_buf);
  // Work of this session still running lands nowhere.
  g_base = g_next_launch.load();
  return out;
}

void push_correlation(uint64_t id) {
  auto& st = state();
  Corr c{id, now_ns()};
  st.stack.push_back(c);
  st.last = c;
}

void pop_correlation() {
  auto& st = state();
  if (!st.stack.empty()) st.stack.pop_back();
}

void on_record(const RecordKey& key, int64_t bytes_in, int64_t bytes_out) {
  auto& st = state();
  Corr c = current(st);
  RecordEntry r;
  r.key = key;
  r.bytes_in = bytes_in;
  r.bytes_out = bytes_out;
  r.correlation = c.id;
  r.op_start_ns = std::max(c.start_ns, g_last_end[key.device & 63].load(std::memory_order_relaxed));
  r.time_ns = now_ns();
  r.thread = st.thread;
  std::lock_guard<std::mutex> g(g_mu);
  int64_t idx = static_cast<int64_t>(g_buf.records.size());
  if (st.unbound_launch > g_base && st.unbound_corr == c.id) {
    auto& l = g_buf.launches[st.unbound_launch - g_base - 1];
    if (l.record < 0) {
      l.record = idx;
      r.launch = st.unbound_launch;
    }
    st.unbound_launch = 0;
  }
  g_buf.records.push_back(r);
  if (!r.launch) {
    if (st.pending.size() == 8) st.pending.erase(st.pending.begin());
    st.pending.push_back(idx);
  }
}

Launch on_launch(const char* op, c10::DeviceIndex d, int64_t stream) {
  // Event records and waits are ordering marks, not kernels.
  if (std::strncmp(op, "neuron::event_", 14) == 0) return {};
  auto& st = state();
  Corr c = current(st);
  LaunchEntry e;
  e.op = op;
  e.device = d;
  e.stream = stream;
  e.correlation = c.id;
  e.launch_ns = now_ns();
  e.thread = st.thread;
  std::lock_guard<std::mutex> g(g_mu);
  uint64_t id = g_base + g_buf.launches.size() + 1;
  g_next_launch.store(id);
  auto& recs = g_buf.records;
  for (auto it = st.pending.rbegin(); it != st.pending.rend(); ++it) {
    if (*it >= int64_t(recs.size())) continue;
    auto& r = recs[*it];
    if (r.correlation == c.id && r.launch == 0 && same_kernel(r.key.name, op)) {
      e.record = *it;
      r.launch = id;
      st.pending.erase(std::next(it).base());
      break;
    }
  }
  if (e.record < 0) {
    st.unbound_launch = id;
    st.unbound_corr = c.id;
  }
  g_buf.launches.push_back(e);
  return {id};
}

void on_run(const Launch& l, int64_t start_ns, int64_t end_ns) {
  std::lock_guard<std::mutex> g(g_mu);
  if (l.id <= g_base || l.id - g_base > g_buf.launches.size()) return;
  auto& e = g_buf.launches[l.id - g_base - 1];
  e.start_ns = start_ns;
  e.end_ns = end_ns;
  g_last_end[e.device & 63].store(end_ns, std::memory_order_relaxed);
}

void add(int32_t device, std::string name, std::string engine, double seconds, int64_t launches,
         double flops, int64_t hbm_bytes, int64_t link_bytes, int32_t group_size, int32_t nodes) {
  auto& st = state();
  Corr c = current(st);
  AddedEntry a;
  a.name = std::move(name);
  a.engine = std::move(engine);
  a.device = device;
  a.seconds = seconds;
  a.launches = launches;
  a.flops = flops;
  a.hbm_bytes = hbm_bytes;
  a.link_bytes = link_bytes;
  a.group_size = group_size;
  a.nodes = nodes;
  a.correlation = c.id;
  a.end_ns = now_ns();
  // The Python kernel ran inside the op that charges its time; a compiled graph's modelled
  // time is charged after its kernels ran (each its own event): a point, not a second span.
  a.start_ns = (a.engine == "fused" || st.stack.empty()) ? a.end_ns : c.start_ns;
  a.thread = st.thread;
  std::lock_guard<std::mutex> g(g_mu);
  g_buf.added.push_back(std::move(a));
}

}  // namespace neuron::trace
