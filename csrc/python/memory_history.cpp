// Bindings of the allocator's memory history: the stack hook, and the snapshot as the dict
// PyTorch's memory viewer (torch.cuda._memory_viz, pytorch.org/memory_viz) reads.
#include "../runtime/history.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

// From torch/csrc/profiler/python/combined_traceback.h (libtorch_python exports them), whose
// header needs nlohmann/json, which torch's wheel does not ship.
namespace torch {
std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
void freeDeadCapturedTracebackFrames();
}  // namespace torch

namespace {

// torch's CapturedTraceback, as CUDA's allocator uses: it keeps code objects and instruction
// offsets (symbolized only when a snapshot is taken), and it gathers Python frames only on
// threads Python knows, so the device's queue threads (no Python state) take no GIL and get
// no frames.
neuron::history::Context gather(bool cpp) {
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, cpp);
}

constexpr int64_t kSmallSegment = int64_t(1) << 20;  // CUDA's small pool: blocks up to 1 MiB

py::dict snapshot() {
  neuron::history::Snapshot s;
  {
    // Taking it closes the fusion windows, whose work may free blocks (and gather stacks).
    py::gil_scoped_release no_gil;
    s = neuron::history::snapshot();
  }
  // Symbolize every stack at once: frames shared between stacks become one dict each.
  std::vector<torch::CapturedTraceback*> stacks;
  std::unordered_map<const c10::GatheredContext*, size_t> index;
  auto want = [&](const neuron::history::Context& c) {
    if (c && index.emplace(c.get(), stacks.size()).second) {
      stacks.push_back(torch::getCapturedTracebackFromContext(c));
    }
  };
  for (auto& b : s.blocks) want(b.context);
  for (auto& t : s.traces) for (auto& e : t) want(e.context);
  std::vector<py::object> symbolized = torch::py_symbolize(stacks);
  auto frames = [&](const neuron::history::Context& c) -> py::object {
    return c ? symbolized.at(index.at(c.get())) : py::list();
  };

  py::list segments;
  for (auto& b : s.blocks) {
    const std::string state = b.state;
    py::dict block;
    block["address"] = b.addr;
    block["size"] = b.size;
    block["requested_size"] = b.requested;
    block["state"] = state;
    block["frames"] = frames(b.context);
    py::dict seg;
    seg["device"] = int(b.device);
    seg["address"] = b.addr;
    seg["total_size"] = b.size;
    seg["allocated_size"] = state == "active_allocated" ? b.size : 0;
    seg["active_size"] = state == "inactive" ? 0 : b.size;
    seg["requested_size"] = b.requested;
    seg["stream"] = b.stream;
    seg["segment_type"] = b.size <= kSmallSegment ? "small" : "large";
    seg["segment_pool_id"] = py::make_tuple(0, 0);
    seg["is_expandable"] = false;
    seg["frames"] = frames(b.context);
    py::list blocks;
    blocks.append(block);
    seg["blocks"] = blocks;
    segments.append(seg);
  }
  py::list traces;
  for (auto& t : s.traces) {
    py::list trace;
    for (auto& e : t) {
      py::dict entry;
      const std::string action = e.action;
      entry["action"] = action;
      entry["addr"] = e.addr;
      entry["size"] = e.size;
      entry["stream"] = e.stream;
      entry["time_us"] = e.time_us;
      entry["frames"] = frames(e.context);
      if (action == "oom") entry["device_free"] = e.device_free;
      trace.append(entry);
    }
    traces.append(trace);
  }
  py::dict out;
  out["segments"] = segments;
  out["device_traces"] = traces;
  // Code objects of stacks the allocator dropped (ring overwrites, frees) are released here,
  // under the GIL, rather than where they were dropped (perhaps under the allocator's lock).
  torch::freeDeadCapturedTracebackFrames();
  return out;
}

}  // namespace

void init_memory_history(py::module& m) {
  neuron::history::set_gather(&gather);
  m.def("_memory_record_history",
        [](bool enabled, bool trace, size_t max_entries, bool stack_blocks, bool stack_allocs,
           bool stack_frees, bool cpp, bool clear, std::vector<std::string> skip) {
          neuron::history::Options o;
          o.enabled = enabled;
          o.trace = trace;
          o.max_entries = max_entries;
          o.stack_blocks = stack_blocks;
          o.stack_allocs = stack_allocs;
          o.stack_frees = stack_frees;
          o.cpp = cpp;
          o.clear = clear;
          o.skip = std::move(skip);
          neuron::history::record(o);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("_memory_snapshot", &snapshot);
}
