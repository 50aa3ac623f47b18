// The Kineto activity profiler of the PrivateUse1 backend: with torch.profiler's PrivateUse1
// activity, every piece of work the runtime ran becomes a device event (kernel) on its
// device's queue, linked to the op that launched it (hence its Python line with stacks) and
// to a runtime event on the launching thread, as CUPTI's kernels are on CUDA. Durations are
// host execution on the queue's executor; the cost model's Trainium time is metadata.
// fmt (used by Kineto's GenericTraceActivity) is not exported by libtorch: compile it in.
#define FMT_HEADER_ONLY
#include "trace.h"

#include "../runtime/runtime.h"

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>

#include <libkineto.h>
#include <output_base.h>

#include <cstring>
#include <set>
#include <tuple>

namespace neuron::profiler {

namespace {

namespace py = pybind11;
using libkineto::ActivityType;

// Our correlation ids (kernel <-> runtime event) sit far above torch.profiler's op ids.
constexpr int32_t kCorrelationBase = 1 << 30;

// Kineto writes names into its JSON unescaped: compiled kernels' names quote source lines.
std::string json_safe(std::string s) {
  for (char& c : s) {
    if (c == '"') c = '\'';
    else if (c == '\\' || static_cast<unsigned char>(c) < 0x20) c = ' ';
  }
  return s;
}

std::string short_name(const char* op) {
  const char* p = std::strstr(op, "::");
  return json_safe(p ? std::string(p + 2) : std::string(op));
}

// Ids are unique across sessions, so a stale lookup by id cannot hit another trace's kernel.
std::atomic<int32_t> g_next_correlation{kCorrelationBase};

// Python's half (torch_neuronx/profiling/_kineto.py). Runs with the GIL; a Python error is
// reported as the session's error and as a warning, never dropped.
py::object kineto_module() { return py::module_::import("torch_neuronx.profiling._kineto"); }

PyObject* py_add(PyObject*, PyObject* args) {
  int device;
  const char *name, *engine;
  double seconds;
  long long launches, hbm_bytes, link_bytes;
  double flops;
  int group_size, nodes;
  if (!PyArg_ParseTuple(args, "issdLdLLii", &device, &name, &engine, &seconds, &launches, &flops,
                        &hbm_bytes, &link_bytes, &group_size, &nodes))
    return nullptr;
  trace::add(device, name, engine, seconds, launches, flops, hbm_bytes, link_bytes, group_size,
             nodes);
  Py_RETURN_NONE;
}
PyMethodDef g_add_def = {"trace_added", py_add, METH_VARARGS,
                         "(device, name, engine, seconds, launches, flops, hbm_bytes, link_bytes, "
                         "group_size, nodes): work only Python sees"};

// The cost model's view of one launch.
struct Cost {
  double seconds = 0;
  std::string engine = "unknown";
  double flops = 0;
  int64_t hbm_bytes = 0;
  int64_t link_bytes = 0;             // collectives only (group_size > 0)
  int32_t group_size = 0, nodes = 0;
};

class Session final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    trace::start();
    call_python("_session_started", true);
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    // Work still queued belongs to the profiled region: let it run before collecting.
    for (c10::DeviceIndex d = 0; d < device_count(); ++d) queue::wait_idle(d);
    trace::stop();
    call_python("_session_stopped", false);
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return errors_; }

  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, [](int32_t) -> const libkineto::ITraceActivity* { return nullptr; }, 0, 0);
  }

  void processTrace(libkineto::ActivityLogger& logger,
                    libkineto::getLinkedActivityCallback linked, int64_t start,
                    int64_t end) override {
    trace::Buffers b = trace::take();
    buf_->span = libkineto::TraceSpan(start, end, "neuron");
    std::vector<Cost> cost = modelled(b.records);
    const int32_t pid = libkineto::processId();
    auto emit = [&](const std::string& name, int32_t device, int64_t stream, int32_t thread,
                    uint64_t op_corr, int64_t launch_ns, int64_t s, int64_t e, const Cost& c,
                    const char* kind) {
      const int32_t corr = g_next_correlation.fetch_add(1);
      const libkineto::ITraceActivity* op = op_corr ? linked(static_cast<int32_t>(op_corr)) : nullptr;
      buf_->emplace_activity(buf_->span, ActivityType::PRIVATEUSE1_RUNTIME, "neuronLaunchKernel");
      auto& rt = *buf_->activities.back();
      rt.startTime = rt.endTime = launch_ns;
      rt.device = pid;
      rt.resource = thread;
      rt.threadId = thread;
      rt.id = corr;
      rt.linked = op;
      rt.flow.id = corr;
      rt.flow.type = libkineto::kLinkAsyncCpuGpu;
      rt.flow.start = 1;
      rt.addMetadata("correlation", corr);
      buf_->emplace_activity(buf_->span, ActivityType::CONCURRENT_KERNEL, name);
      auto& k = *buf_->activities.back();
      k.startTime = s;
      k.endTime = e;
      k.device = device;
      k.resource = static_cast<int32_t>(stream);
      k.id = corr;
      k.linked = op;
      k.flow.id = corr;
      k.flow.type = libkineto::kLinkAsyncCpuGpu;
      k.flow.start = 0;
      k.addMetadata("device", device);
      k.addMetadata("stream", stream);
      k.addMetadata("correlation", corr);
      k.addMetadata("modelled_ns", static_cast<int64_t>(c.seconds * 1e9 + 0.5));
      k.addMetadataQuoted("engine", c.engine);
      k.addMetadata("flops", static_cast<int64_t>(c.flops));
      k.addMetadata("hbm_bytes", c.hbm_bytes);
      k.addMetadataQuoted("launch", kind);
      if (c.group_size > 0) {
        k.addMetadata("link_bytes", c.link_bytes);
        k.addMetadata("group_size", c.group_size);
        k.addMetadata("nodes", c.nodes);
      }
      streams_.insert({device, stream});
      logger.handleActivity(rt);
      logger.handleActivity(k);
    };
    for (const auto& l : b.launches) {
      if (l.end_ns == 0) continue;
      Cost c;
      c.engine = "fused";  // a compiled graph's kernel: the graph's event carries the time
      if (l.record >= 0) c = cost[l.record];
      emit(short_name(l.op), l.device, l.stream, l.thread, l.correlation, l.launch_ns, l.start_ns,
           l.end_ns, c, l.record >= 0 ? "queued" : "graph");
    }
    // Records of no launch: synchronous ops, which ran on the calling thread within the op.
    for (size_t i = 0; i < b.records.size(); ++i) {
      const auto& r = b.records[i];
      if (r.launch) continue;
      int64_t s = r.op_start_ns ? r.op_start_ns : r.time_ns;
      emit(short_name(r.key.name), r.key.device, r.key.stream, r.thread, r.correlation, s, s,
           r.time_ns, cost[i], "sync");
    }
    for (const auto& a : b.added) {
      Cost c;
      c.seconds = a.seconds;
      c.engine = a.engine;
      c.flops = a.flops;
      c.hbm_bytes = a.hbm_bytes;
      c.link_bytes = a.link_bytes;
      c.group_size = a.group_size;
      c.nodes = a.nodes;
      emit(json_safe(a.name), a.device, 0, a.thread, a.correlation, a.start_ns, a.start_ns, a.end_ns, c,
           "python");
    }
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    return std::make_unique<libkineto::DeviceInfo>(
        libkineto::DeviceInfo{0, libkineto::kExceedMaxPid, "neuron", "neuron:0"});
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::vector<libkineto::ResourceInfo> out;
    for (const auto& [d, s] : streams_) {
      out.push_back({s, s, d, "queue " + std::to_string(s)});
    }
    return out;
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return std::move(buf_); }

  void pushCorrelationId(uint64_t id) override { trace::push_correlation(id); }
  void popCorrelationId() override { trace::pop_correlation(); }

 private:
  void call_python(const char* fn, bool pass_add) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    try {
      if (pass_add) {
        py::object add = py::reinterpret_steal<py::object>(PyCFunction_New(&g_add_def, nullptr));
        kineto_module().attr(fn)(add);
      } else {
        kineto_module().attr(fn)();
      }
    } catch (py::error_already_set& e) {
      report(std::string("neuron profiler: ") + fn + " failed: " + e.what());
    }
  }

  // Modelled Trainium time, engine, FLOPs and HBM bytes of each record (Python's cost model).
  std::vector<Cost> modelled(const std::vector<trace::RecordEntry>& recs) {
    std::vector<Cost> out(recs.size());
    if (recs.empty() || !Py_IsInitialized()) return out;
    py::gil_scoped_acquire gil;
    try {
      py::list items;
      for (const auto& r : recs) {
        py::list sig;
        for (int i = 0; i < r.key.len; ++i) sig.append(r.key.sig[i]);
        items.append(py::make_tuple(r.key.name, int(r.key.device), int(r.key.dtype), sig,
                                    r.bytes_in, r.bytes_out));
      }
      py::list res = kineto_module().attr("_modelled")(items);
      for (size_t i = 0; i < recs.size(); ++i) {
        py::tuple t = res[i];
        out[i] = {t[0].cast<double>(), t[1].cast<std::string>(), t[2].cast<double>(),
                  t[3].cast<int64_t>()};
      }
    } catch (py::error_already_set& e) {
      report(std::string("neuron profiler: modelled time failed: ") + e.what());
    }
    return out;
  }

  void report(const std::string& msg) {
    errors_.push_back(msg);
    status_ = libkineto::TraceStatus::ERROR;
    TORCH_WARN(msg);
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> buf_ = std::make_unique<libkineto::CpuTraceBuffer>();
  std::set<std::pair<int32_t, int64_t>> streams_;
  std::vector<std::string> errors_;
};

class NeuronActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<ActivityType>& availableActivities() const override { return activities_; }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      const std::set<ActivityType>& types, const libkineto::Config&) override {
    // Only with torch.profiler's PrivateUse1 activity (which asks for kernels): a CPU-only
    // profile pays nothing on launches.
    if (!types.count(ActivityType::CONCURRENT_KERNEL)) return nullptr;
    return std::make_unique<Session>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      int64_t, int64_t, const std::set<ActivityType>& types, const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"neuron"};
  std::set<ActivityType> activities_{ActivityType::CONCURRENT_KERNEL,
                                     ActivityType::PRIVATEUSE1_RUNTIME};
};

REGISTER_PRIVATEUSE1_PROFILER(NeuronActivityProfiler);

}  // namespace

}  // namespace neuron::profiler
