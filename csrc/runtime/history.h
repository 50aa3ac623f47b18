// Memory history (torch.neuron.memory._record_memory_history / _snapshot), kept by the
// caching allocator (allocator.cpp) because the blocks are there. A header of its own: only
// the allocator and its bindings need it.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace neuron {
// While recording, the allocator keeps the blocks it hands out and, with `trace`, a ring per
// device of its actions, each with the stack the bindings' `gather` hook takes (the runtime
// has no Python). While off, an allocation or free pays one flag test.
namespace history {
using Context = std::shared_ptr<c10::GatheredContext>;
struct Options {
  bool enabled = false;
  bool trace = false;         // "all": keep the ring of actions; "state": only live blocks
  size_t max_entries = 0;     // ring size per device
  bool stack_blocks = false;  // stacks of live blocks (context "state", "alloc", "all")
  bool stack_allocs = false;  // ... and of alloc entries ("alloc", "all")
  bool stack_frees = false;   // ... and of free entries ("all")
  bool cpp = false;           // C++ frames too (stacks "all")
  bool clear = false;         // drop the ring when (re)enabling
  std::vector<std::string> skip;  // actions not to keep in the ring
};
void set_gather(Context (*gather)(bool cpp));
void record(const Options& o);
struct Entry {
  const char* action;  // alloc, free_requested, free_completed, segment_alloc, segment_free, oom
  c10::DeviceIndex device;
  uint64_t addr;
  int64_t size;
  int64_t stream;
  int64_t time_us;
  int64_t device_free;  // oom only
  Context context;
};
struct Block {  // one per segment: the allocator never splits a block
  c10::DeviceIndex device;
  uint64_t addr;
  int64_t size;
  int64_t requested;
  const char* state;  // active_allocated, active_pending_free, inactive
  int64_t stream;
  Context context;
};
struct Snapshot {
  std::vector<Block> blocks;
  std::vector<std::vector<Entry>> traces;  // per device, oldest first
};
Snapshot snapshot();
}  // namespace history

}  // namespace neuron
