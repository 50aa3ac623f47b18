// What the runtime's trace hooks (record.h, namespace trace) collect while a profiler session
// runs, handed to the Kineto plugin (kineto_plugin.cpp) when the session ends.
#pragma once

#include "../runtime/record.h"

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace neuron::trace {

// The op record of one launch (or of a synchronous op, which has no launch).
struct RecordEntry {
  RecordKey key;
  int64_t bytes_in = 0, bytes_out = 0;
  uint64_t correlation = 0;  // torch.profiler's id of the op that made the record
  int64_t op_start_ns = 0;   // when that op started
  int64_t time_ns = 0;
  int32_t thread = 0;
  uint64_t launch = 0;       // the launch it belongs to; 0 for a synchronous op
};

// One piece of queued or inline work and its execution on the device's executor.
struct LaunchEntry {
  const char* op = nullptr;
  int32_t device = 0;
  int64_t stream = 0;
  uint64_t correlation = 0;
  int64_t launch_ns = 0;
  int32_t thread = 0;
  int64_t record = -1;  // index into records, -1 if the work has no op record
  int64_t start_ns = 0, end_ns = 0;  // 0: never ran (skipped after an error)
};

// Work whose modelled time Python adds (NKI kernels, collectives, compiled graphs).
struct AddedEntry {
  std::string name, engine;
  int32_t device = 0;
  double seconds = 0;
  int64_t launches = 0;
  uint64_t correlation = 0;
  int64_t start_ns = 0, end_ns = 0;
  int32_t thread = 0;
  double flops = 0;
  int64_t hbm_bytes = 0;
  // collectives: the bytes over the interconnect, the group's ranks and the nodes they span
  int64_t link_bytes = 0;
  int32_t group_size = 0, nodes = 0;
};

struct Buffers {
  std::vector<RecordEntry> records;
  std::deque<LaunchEntry> launches;
  std::vector<AddedEntry> added;
};

// The session's side: start collecting (clears), stop, and take what was collected.
void start();
void stop();
Buffers take();
// torch.profiler's correlation id of the op running on this thread (Kineto pushes and pops it).
void push_correlation(uint64_t id);
void pop_correlation();
void add(int32_t device, std::string name, std::string engine, double seconds, int64_t launches,
         double flops, int64_t hbm_bytes, int64_t link_bytes, int32_t group_size, int32_t nodes);

}  // namespace neuron::trace
