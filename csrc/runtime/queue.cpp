// The device's work queues. A NeuronCore executes what the host enqueues, asynchronously and
// in order; here each device has one executor thread that runs launched work in launch order.
// One in-order executor serves every stream of a device: launch order already respects each
// stream's order and every event wait the host issued, so results are those of any schedule
// the chip may pick (cross-stream races are the stream checker's business).
//
// Errors inside queued work are kept (the first one, with the op and the Python line that
// launched it), the rest of the already-queued work is skipped, and the error is raised by
// the next call that waits for the device; new work then runs normally again.
#include "runtime.h"

#include <Python.h>
#include <omp.h>
#include <pthread.h>

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

// MKL's per-thread count, C interface (libtorch_cpu links MKL in statically and exports it;
// its lower-case name is the Fortran one, which takes a pointer).
extern "C" int MKL_Set_Num_Threads_Local(int);

namespace neuron::queue {

namespace {

std::atomic<bool> g_blocking{false};
std::atomic<int> g_device_threads{0};  // 0: each launch takes its launcher's count
thread_local int t_sync_depth = 0;
thread_local bool t_executor = false;  // this thread is a device's executor
thread_local int t_compiled = 0;        // depth of compiled-graph calls on this thread

// ATen initialises a thread's counts at its first parallel call, from the process-wide
// setting: done now for libtorch's and this library's copies of that check, so that a count
// set on this thread afterwards stays.
void init_thread_counts() {
  (void)at::get_num_threads();
  at::internal::lazy_init_num_threads();
}

Site (*g_capture)() = nullptr;
std::string (*g_describe)(const Site&) = nullptr;

enum class Kind { Error, Index, Value, Type, NotImplemented };

// The Python exception type a failed kernel's error maps to, kept for the rethrow.
Kind kind_of(const c10::Error& e) {
  if (dynamic_cast<const c10::IndexError*>(&e)) return Kind::Index;
  if (dynamic_cast<const c10::ValueError*>(&e)) return Kind::Value;
  if (dynamic_cast<const c10::TypeError*>(&e)) return Kind::Type;
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return Kind::NotImplemented;
  return Kind::Error;
}

struct Item {
  uint64_t seq = 0;
  const char* op = nullptr;
  int64_t bytes = 0;
  Site site;
  trace::Launch traced;
  // The launching thread's InferenceMode: work queued under torch.inference_mode (vLLM's
  // steps) writes inference tensors, which only that mode may update in place.
  bool inference = false;
  // The launching thread's intra-op thread count (torch.set_num_threads): ATen's parallel
  // reductions, MKL's GEMMs and kernels that plan their work split on the host (vLLM's CPU
  // attention) give results that depend on it, so the work runs with the launcher's count.
  int threads = 1;
  std::function<void()> run;
};

// Bounded like a hardware launch queue: a host that runs far ahead waits for room.
constexpr size_t kMaxQueued = 4096;
// Work touching this much memory runs long enough (~100 us) that a host waiting for it sleeps.
constexpr int64_t kBigBytes = int64_t(2) << 20;
constexpr int64_t kHostSpinMicros = 2000;  // at most, while small work runs
// The executor, for the next launch. Eager programs of small kernels launch every 10-20 us
// with gaps of Python between bursts: an executor that slept after 30 us paid a futex wake-up
// (and the host a syscall) on about every other launch, and the host's time went to the
// scheduler (fresh-process steps, 30 us -> 1 ms: Mamba 17.1 -> 9.8-13.6 ms, the RSSM 13.4-14.5
// -> 10.1-10.7, DiT 8.7-9.0 -> 7.0-7.6; bench/RESULTS.md). Longer (3 ms) slowed steps
// whose host runs parallel kernels itself (the RSSM's multinomial), the spin taking their core.
constexpr int64_t kIdleSpinMicros = 1000;

// Spins (yielding) until `ready` or for `micros`.
template <class F>
void spin_until(F&& ready, int64_t micros) {
  auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
  for (int i = 0; !ready(); ++i) {
    if ((i & 15) == 15 && std::chrono::steady_clock::now() > until) return;
    std::this_thread::yield();
  }
}

class DeviceQueue {
 public:
  explicit DeviceQueue(c10::DeviceIndex d) : device_(d) {}

  uint64_t launch(const char* op, int64_t stream, std::function<void()> run, int64_t bytes,
                  int threads = 0) {
    Item it;
    it.op = op;
    it.bytes = bytes;
    it.run = std::move(run);
    it.inference = c10::InferenceMode::is_enabled();
    it.threads = threads > 0 ? threads : launch_threads(bytes);
    if (g_capture) it.site = g_capture();
    if (trace::on()) it.traced = trace::on_launch(op, device_, stream);
    std::unique_lock<std::mutex> lk(mu_);
    if (items_.size() >= kMaxQueued) {
      ++waiters_;
      release_gil_while([&] { room_.wait(lk, [&] { return items_.size() < kMaxQueued / 2; }); });
      --waiters_;
    }
    if (!started_) start_locked();
    std::vector<std::function<void()>> garbage;
    if (finished_.size() >= 64) garbage.swap(finished_);
    it.seq = ++launched_;
    stream_last_[stream] = it.seq;
    items_.push_back(std::move(it));
    queued_.store(items_.size(), std::memory_order_release);
    if (sleeping_) work_.notify_one();
    uint64_t seq = launched_;
    lk.unlock();
    garbage.clear();
    return seq;
  }

  // Releases what finished work held (device memory included).
  void collect() {
    std::vector<std::function<void()>> garbage;
    std::lock_guard<std::mutex> g(mu_);
    garbage.swap(finished_);
  }

  uint64_t last(int64_t stream) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = stream_last_.find(stream);
    return it == stream_last_.end() ? 0 : it->second;
  }
  uint64_t launched() {
    std::lock_guard<std::mutex> g(mu_);
    return launched_;
  }
  bool done(uint64_t seq) { return done_.load(std::memory_order_acquire) >= seq; }

  // Waits until work `seq` has run, then raises a pending error.
  void wait(uint64_t seq) {
    wait_quietly(seq);
    raise_pending();
  }

  void wait_quietly(uint64_t seq) {
    if (!done(seq)) {
      const bool host = std::this_thread::get_id() != executor_id_;
      // Small work not yet started that the host waits for runs on the host, in order:
      // handing it to a sleeping executor would cost two wake-ups (~0.1-0.2 ms) for
      // nothing. Large work stays on the executor: its parallel loops run on the
      // executor's OpenMP team, and alternating two teams leaves one spinning on a core
      // the other needs.
      std::unique_lock<std::mutex> lk(mu_);
      ++waiters_;
      release_gil_while([&] {
        while (!done(seq)) {
          if (host && !running_ && !items_.empty() && items_.front().seq <= seq &&
              items_.front().bytes < kBigBytes &&
              items_.front().threads == at::get_num_threads()) {
            run_next_locked(lk);
            continue;
          }
          // Small work finishes sooner than a sleeping host wakes up: spin while it runs.
          // Large work runs a parallel loop over every core, and a spinning host would take
          // one from it (memory-bound ops ran 2-3x slower than on the host thread): sleep.
          lk.unlock();
          spin_until([&] { return done(seq) || big_.load(std::memory_order_relaxed); },
                     kHostSpinMicros);
          lk.lock();
          if (!done(seq) && running_) done_cv_.wait(lk);
        }
      });
      --waiters_;
    }
    collect();
  }

  void raise_pending() {
    if (!failed_.load(std::memory_order_acquire)) return;
    std::string msg;
    Kind kind;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!failed_.load()) return;
      msg = std::move(error_);
      kind = kind_;
      failed_.store(false);
    }
    switch (kind) {
      case Kind::Index: TORCH_CHECK_INDEX(false, msg);
      case Kind::Value: TORCH_CHECK_VALUE(false, msg);
      case Kind::Type: TORCH_CHECK_TYPE(false, msg);
      case Kind::NotImplemented: TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
      default: TORCH_CHECK(false, msg);
    }
  }

  std::vector<std::string> take_warnings() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::string> out;
    out.swap(warnings_);
    return out;
  }

  int64_t executed() const { return executed_.load(); }

  void after_fork() {
    // The executor thread does not exist in a forked child: start over, empty.
    new (&mu_) std::mutex();
    new (&work_) std::condition_variable();
    new (&done_cv_) std::condition_variable();
    new (&room_) std::condition_variable();
    items_.clear();
    new (&finished_) std::vector<std::function<void()>>();
    done_.store(launched_);
    started_ = false;
    sleeping_ = false;
    running_ = false;
    executor_id_ = std::thread::id();
    waiters_ = 0;
  }

 private:
  template <class F>
  static void release_gil_while(F&& f) {
    if (Py_IsInitialized() && PyGILState_Check()) {
      PyThreadState* s = PyEval_SaveThread();
      f();
      PyEval_RestoreThread(s);
    } else {
      f();
    }
  }

  void start_locked() {
    started_ = true;
    std::thread([this] { loop(); }).detach();
  }

  // The host runs the next queued item itself (called holding `lk`, returns holding it).
  // Warnings it raises are delivered at the end of the wait, as the executor's are.
  void run_next_locked(std::unique_lock<std::mutex>& lk) {
    Item it = std::move(items_.front());
    items_.pop_front();
    queued_.store(items_.size(), std::memory_order_release);
    running_ = true;
    lk.unlock();
    {
      c10::WarningUtils::WarningHandlerGuard guard(&collect_);
      if (!failed_.load(std::memory_order_relaxed)) run_item(it);
    }
    executed_.fetch_add(1, std::memory_order_relaxed);
    lk.lock();
    running_ = false;
    hand_back_locked(it.run, it.seq);
    if (sleeping_ && !items_.empty()) work_.notify_one();
  }

  // Warnings raised by queued kernels reach the user at the next wait, from the host thread.
  struct Collect : c10::WarningHandler {
    DeviceQueue* q;
    explicit Collect(DeviceQueue* q) : q(q) {}
    void process(const c10::Warning& w) override {
      std::lock_guard<std::mutex> g(q->mu_);
      if (q->warnings_.size() < 64) q->warnings_.push_back(w.msg());
    }
  };

  void loop() {
    executor_id_ = std::this_thread::get_id();
    t_executor = true;
    init_thread_counts();
    c10::WarningUtils::set_warning_handler(&collect_);
    for (;;) {
      Item it;
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (items_.empty() || running_) {
          lk.unlock();
          // Launches come in bursts: spin briefly before sleeping so a burst is not
          // paid for with one wake-up per op.
          spin_until([&] { return pending_hint(); }, kIdleSpinMicros);
          lk.lock();
          // running_: a waiting host is running the next item itself.
          while (items_.empty() || running_) {
            sleeping_ = true;
            work_.wait(lk);
            sleeping_ = false;
          }
        }
        it = std::move(items_.front());
        items_.pop_front();
        queued_.store(items_.size(), std::memory_order_release);
        running_ = true;
        if (waiters_ && items_.size() < kMaxQueued / 2) room_.notify_all();
      }
      big_.store(it.bytes >= kBigBytes, std::memory_order_relaxed);
      if (!failed_.load(std::memory_order_relaxed)) run_item(it);
      big_.store(false, std::memory_order_relaxed);
      executed_.fetch_add(1, std::memory_order_relaxed);
      // The work's tensors are released by the host thread (at its next launch or wait):
      // freeing memory the host allocated from this thread would contend on malloc's arena.
      std::lock_guard<std::mutex> g(mu_);
      running_ = false;
      hand_back_locked(it.run, it.seq);
    }
  }

  // Marks work `seq` done and gives what it held to the host; wakes a waiting host.
  void hand_back_locked(std::function<void()>& run, uint64_t seq) {
    finished_.push_back(std::move(run));
    run = nullptr;
    done_.store(seq, std::memory_order_release);
    if (waiters_) {
      done_cv_.notify_all();
      room_.notify_all();
    }
  }

  void run_item(Item& it) {
    // Only the executor adopts the count; a waiting host runs only work of its own count.
    // Checked each time: ATen's first parallel call from each library on this thread
    // (libtorch, this one, any extension) resets the count to the process-wide setting.
    if (std::this_thread::get_id() == executor_id_ && omp_get_max_threads() != it.threads) {
      // This thread's own counts (OpenMP's is per thread; MKL's local one): at::set_num_threads
      // would also set MKL's process-wide count, which the host's own CPU work reads.
      omp_set_num_threads(it.threads);
      MKL_Set_Num_Threads_Local(it.threads);
    }
    if (it.inference) {
      c10::InferenceMode guard;
      execute(it.op, it.site, it.run, false, it.traced);
    } else {
      execute(it.op, it.site, it.run, false, it.traced);
    }
  }

  bool pending_hint() { return queued_.load(std::memory_order_acquire) > 0; }

  // Runs one piece of work; an error is kept, with the op and its launch site, for the next
  // wait to raise, and the work queued after it is skipped.
  void execute(const char* op, Site& site, c10::function_ref<void()> run, bool holding_lock,
               const trace::Launch& traced) {
    Kind kind;
    std::string what;
    try {
      if (traced.id) {
        int64_t start = trace::now_ns();
        run();
        trace::on_run(traced, start, trace::now_ns());
      } else {
        run();
      }
      return;
    } catch (const c10::Error& e) {
      kind = kind_of(e), what = e.what_without_backtrace();
    } catch (const std::exception& e) {
      kind = Kind::Error, what = e.what();
    }
    // Run here on the host (holding_lock), the launching Python frame is still current.
    if (holding_lock && g_capture) site = g_capture();
    std::string where = g_describe ? g_describe(site) : std::string();
    std::unique_lock<std::mutex> g(mu_, std::defer_lock);
    if (!holding_lock) g.lock();
    error_ = std::string("neuron: ") + op + (where.empty() ? "" : " launched at " + where) +
             " failed on the device (work queued after it was skipped): " + what;
    kind_ = kind;
    failed_.store(true, std::memory_order_release);
  }

  c10::DeviceIndex device_;
  std::mutex mu_;
  Collect collect_{this};
  std::thread::id executor_id_;
  bool running_ = false;  // an item is running (on the executor, or on a waiting host)
  std::condition_variable work_, done_cv_, room_;
  std::deque<Item> items_;
  std::vector<std::function<void()>> finished_;
  std::unordered_map<int64_t, uint64_t> stream_last_;
  uint64_t launched_ = 0;
  std::atomic<uint64_t> done_{0};
  std::atomic<int64_t> executed_{0};
  std::atomic<size_t> queued_{0};
  bool started_ = false;
  bool sleeping_ = false;
  int waiters_ = 0;
  std::atomic<bool> failed_{false};
  std::atomic<bool> big_{false};  // the executor is running large work
  std::string error_;
  Kind kind_ = Kind::Error;
  std::vector<std::string> warnings_;
};

constexpr int kMaxDevices = 64;
std::array<std::atomic<DeviceQueue*>, kMaxDevices> g_queues{};
std::mutex g_create_mu;

// Queues live for the whole process (their threads are detached).
DeviceQueue& get(c10::DeviceIndex d) {
  auto* q = g_queues[d].load(std::memory_order_acquire);
  if (q) return *q;
  std::lock_guard<std::mutex> g(g_create_mu);
  q = g_queues[d].load();
  if (!q) {
    q = new DeviceQueue(d);
    g_queues[d].store(q, std::memory_order_release);
  }
  return *q;
}

void emit_warnings(DeviceQueue& q) {
  for (auto& w : q.take_warnings()) TORCH_WARN(w);
}

bool g_atfork = [] {
  pthread_atfork(nullptr, nullptr, [] {
    for (auto& slot : g_queues) {
      if (auto* q = slot.load()) q->after_fork();
    }
  });
  return true;
}();

}  // namespace

int device_threads() { return g_device_threads.load(std::memory_order_relaxed); }
void set_device_threads(int n) {
  TORCH_CHECK_VALUE(n >= 0, "set_device_threads: expected a thread count >= 0 (0 follows the "
                    "launching thread's torch.get_num_threads()), got ", n);
  synchronize_all();  // work already queued keeps the count it was launched with
  g_device_threads.store(n);
}
HostThreads::HostThreads(int64_t bytes) {
  if (t_executor || (device_threads() == 0 && t_compiled == 0)) return;
  init_thread_counts();  // ATen's lazy per-thread set-up must not undo this later
  const int n = launch_threads(bytes);
  if (omp_get_max_threads() == n) return;
  omp = omp_get_max_threads();
  omp_set_num_threads(n);
  mkl = MKL_Set_Num_Threads_Local(n);
}
HostThreads::~HostThreads() {
  if (omp == 0) return;
  omp_set_num_threads(omp);
  MKL_Set_Num_Threads_Local(mkl);
}
int launch_threads(int64_t bytes) {
  const int device = device_threads();
  if (device > 0) return device;
  const int n = at::get_num_threads();
  // A compiled graph's small kernels leave the host thread a core. The host keeps issuing
  // the step's work while they run; a team as wide as the machine then waits at each of its
  // barriers for a worker the scheduler parked for Python (compiled steps of small models
  // ran 2-4x Inductor-CPU's time). Compiled results are Inductor's within its tolerance, not
  // CPU eager's bits, and the count depends only on the launcher's and the work's size, so
  // a graph gives the same bits on every run. Large work keeps every core: the host is
  // usually waiting for it.
  if (t_compiled > 0 && bytes >= 0 && bytes < kBigBytes && n > 1) return n - 1;
  return n;
}
int enter_compiled() { return t_compiled++; }
void exit_compiled(int depth) { t_compiled = depth; }
bool asynchronous() { return !g_blocking.load(std::memory_order_relaxed) && t_sync_depth == 0; }
void set_blocking(bool on) {
  if (on) synchronize_all();
  g_blocking.store(on);
}
bool blocking() { return g_blocking.load(); }
void enter_sync() {
  synchronize_all();
  ++t_sync_depth;
}
void exit_sync() {
  if (t_sync_depth > 0) --t_sync_depth;
}

void set_site_hooks(Site (*capture)(), std::string (*describe)(const Site&)) {
  g_capture = capture;
  g_describe = describe;
}

namespace {
void (*g_close_window)(c10::DeviceIndex) = nullptr;
void (*g_close_all_windows)() = nullptr;
}  // namespace

void set_window_closer(void (*flush)(c10::DeviceIndex), void (*flush_all)()) {
  g_close_window = flush;
  g_close_all_windows = flush_all;
}
void close_window(c10::DeviceIndex d) {
  if (g_close_window) g_close_window(d);
}
void close_all_windows() {
  if (g_close_all_windows) g_close_all_windows();
}

uint64_t launch_now(c10::DeviceIndex d, int64_t stream, const char* op, std::function<void()> run,
                    int64_t bytes) {
  return get(d).launch(op, stream, std::move(run), bytes);
}

uint64_t launch(c10::DeviceIndex d, int64_t stream, const char* op, std::function<void()> run,
                int64_t bytes, int threads) {
  close_window(d);
  return get(d).launch(op, stream, std::move(run), bytes, threads);
}

void synchronize(c10::DeviceIndex d) {
  close_window(d);
  timeline_barrier(d);
  auto* q = g_queues[d].load(std::memory_order_acquire);
  if (!q) return;
  q->wait(q->launched());
  emit_warnings(*q);
}

void synchronize_all() {
  close_all_windows();
  for (int d = 0; d < kMaxDevices; ++d) {
    if (g_queues[d].load(std::memory_order_acquire)) synchronize(static_cast<c10::DeviceIndex>(d));
  }
}

void synchronize_stream(c10::DeviceIndex d, int64_t stream) {
  close_window(d);
  timeline_barrier(d);
  auto* q = g_queues[d].load(std::memory_order_acquire);
  if (!q) return;
  q->wait(q->last(stream));
  emit_warnings(*q);
}

bool query_stream(c10::DeviceIndex d, int64_t stream) {
  close_window(d);
  auto* q = g_queues[d].load(std::memory_order_acquire);
  if (!q) return true;
  bool done = q->done(q->last(stream));
  if (done) q->raise_pending();
  return done;
}

// Every host wait on a device ends a timeline epoch of the modelled time (device.cpp).
void wait_for(c10::DeviceIndex d, uint64_t seq) {
  timeline_barrier(d);
  if (seq == 0) return;
  get(d).wait(seq);
  emit_warnings(get(d));
}

bool query(c10::DeviceIndex d, uint64_t seq) {
  if (seq == 0) return true;
  auto& q = get(d);
  bool done = q.done(seq);
  if (done) q.raise_pending();
  return done;
}

uint64_t busy_until(c10::DeviceIndex d) {
  auto* q = g_queues[d].load(std::memory_order_acquire);
  if (!q) return 0;
  uint64_t last = q->launched();
  return q->done(last) ? 0 : last;
}

bool has_run(c10::DeviceIndex d, uint64_t seq) {
  auto* q = g_queues[d].load(std::memory_order_acquire);
  return !q || q->done(seq);
}

void wait_idle(c10::DeviceIndex d) {
  auto* q = g_queues[d].load(std::memory_order_acquire);
  if (q) q->wait_quietly(q->launched());
}

std::pair<int64_t, int64_t> counts(c10::DeviceIndex d) {
  auto* q = g_queues[d].load(std::memory_order_acquire);
  if (!q) return {0, 0};
  return {static_cast<int64_t>(q->launched()), q->executed()};
}

}  // namespace neuron::queue
