"""torch.neuron.memory's history and snapshot, checked against the allocations the tests make
(sizes, addresses, source lines) and read by torch's own memory-viewer code."""
from __future__ import annotations

import inspect
import os
import pickle
import threading

import pytest
import torch
from torch.cuda import _memory_viz

import torch_neuronx
from torch_neuronx.profiling import NeuronConfig, NeuronProfiler
from torch_neuronx.profiling.explore import main as explore_main

mem = torch.neuron.memory
KIB4 = 4096          # below 1 MiB the allocator rounds to 512 B: these sizes are exact
KIB8 = 8192
MIB2 = 2 << 20       # a power of two: exact in the 8-classes-per-power-of-two rounding


@pytest.fixture
def recording():
    # Freed blocks cached by earlier tests would be reused instead of fresh segments.
    torch.neuron.synchronize()
    torch.neuron.empty_cache()
    yield
    mem._record_memory_history(None)


def _line() -> int:
    """The caller's next line."""
    return inspect.currentframe().f_back.f_lineno + 1


def _bytes(n, device="neuron"):
    return torch.empty(n, dtype=torch.uint8, device=device)


def _trace(snap, device=0):
    return [(e["action"], e["addr"], e["size"]) for e in snap["device_traces"][device]]


def _where(frames):
    """(file, line, function) of the innermost frame outside the _bytes helper."""
    f = next(f for f in frames if f["name"] != "_bytes")
    return os.path.basename(f["filename"]), f["line"], f["name"]


def test_trace_is_what_happened_with_the_lines_that_did_it(recording):
    mem._record_memory_history(max_entries=1000, stacks="python", clear_history=True)
    la = _line()
    a = _bytes(KIB4)
    b = _bytes(KIB8)
    c = _bytes(MIB2)
    pa, pb, pc = a.data_ptr(), b.data_ptr(), c.data_ptr()
    lf = _line()
    del b
    b2 = _bytes(KIB8)           # the cached block comes back: no new segment
    del a
    torch.neuron.empty_cache()  # a's block goes back to the host
    snap = mem._snapshot()
    assert b2.data_ptr() == pb
    assert _trace(snap) == [
        ("segment_alloc", pa, KIB4), ("alloc", pa, KIB4),
        ("segment_alloc", pb, KIB8), ("alloc", pb, KIB8),
        ("segment_alloc", pc, MIB2), ("alloc", pc, MIB2),
        ("free_requested", pb, KIB8), ("free_completed", pb, KIB8),
        ("alloc", pb, KIB8),
        ("free_requested", pa, KIB4), ("free_completed", pa, KIB4),
        ("segment_free", pa, KIB4)]
    t = snap["device_traces"][0]
    me = "test_trace_is_what_happened_with_the_lines_that_did_it"
    here = os.path.basename(__file__)
    assert [_where(e["frames"]) for e in t[:6]] == [(here, la + i // 2, me) for i in range(6)]
    assert _where(t[6]["frames"]) == (here, lf, me)  # a free carries the del's line (context="all")
    assert t[11]["frames"] == []           # nothing to blame for returning a cached segment
    assert all(e["time_us"] > 0 for e in t)
    # Now: the live blocks, each a segment, with the line that allocated it.
    live = {s["address"]: s for s in snap["segments"] if s["device"] == 0}
    assert {p: (live[p]["total_size"], live[p]["blocks"][0]["state"]) for p in (pb, pc)} == {
        pb: (KIB8, "active_allocated"), pc: (MIB2, "active_allocated")}
    assert pa not in live
    assert _where(live[pc]["blocks"][0]["frames"]) == (here, la + 2, me)
    del b2, c


def test_torch_memory_viewer_reads_the_snapshot(recording, tmp_path):
    mem._record_memory_history(max_entries=100, stacks="python")
    small = _bytes(KIB4)
    big = _bytes(MIB2)
    p_small, p_big = small.data_ptr(), big.data_ptr()
    del small     # leaves a cached, inactive segment
    path = tmp_path / "snap.pickle"
    mem._dump_snapshot(str(path))
    snap = pickle.loads(path.read_bytes())
    for html in (_memory_viz.trace_plot(snap), _memory_viz.segment_plot(snap)):
        assert html.lstrip().startswith("<!DOCTYPE html>") and "snapshot.pickle" in html
    # torch's text views parse the dict; segsum asserts segments = allocated + free.
    summary = _memory_viz.segsum(snap)
    assert f"segments: {len(snap['segments'])}" in summary
    assert "total_allocated: 2.0MiB" in summary
    assert _memory_viz.trace(snap).splitlines()[:7] == ["Device 0 ----------------", "6 entries",
        f"a = cudaMalloc({p_small}, 4.0KiB)", "b = a[0:4.0KiB]",
        f"c = cudaMalloc({p_big}, 2.0MiB)", "d = c[0:2.0MiB]", "del b # 4.0KiB"]
    flame = _memory_viz.memory(snap, format_flamegraph=lambda lines: lines).splitlines()
    (big_line,) = [ln for ln in flame if ln.startswith("stream_0;active_allocated;")]
    assert big_line.endswith(f" {MIB2}") and "test_torch_memory_viewer_reads_the_snapshot" in big_line
    del big


def test_totals_equal_the_allocators_statistics(recording):
    # Blocks handed out before recording started are not tracked: count only a device this
    # test fills itself.
    d = 3
    torch.neuron.synchronize(d)
    before = torch.neuron.memory_allocated(d), torch.neuron.memory_reserved(d)
    mem._record_memory_history(max_entries=100, stacks="python")
    xs = [_bytes(n, f"neuron:{d}") for n in (1000, KIB4, 3 << 20, 5 << 20)]
    del xs[1]
    snap = mem._snapshot()
    segs = [s for s in snap["segments"] if s["device"] == d]
    active = sum(s["allocated_size"] for s in segs)
    assert active == torch.neuron.memory_allocated(d) - before[0]
    assert sum(s["total_size"] for s in segs) == torch.neuron.memory_reserved(d) - before[1]
    assert sorted(b["requested_size"] for s in segs for b in s["blocks"]
                  if b["state"] == "active_allocated") == [1000, 3 << 20, 5 << 20]
    assert [b["state"] for s in segs for b in s["blocks"] if b["size"] == KIB4] == ["inactive"]
    assert torch.neuron.memory_snapshot() == snap["segments"]   # torch.cuda.memory_snapshot's
    del xs


def test_max_entries_keeps_the_newest(recording):
    mem._record_memory_history(max_entries=5, stacks="python", clear_history=True)
    happened = []
    for i in range(1, 5):
        t = _bytes(KIB4 * i)
        p = t.data_ptr()
        del t
        happened += [("segment_alloc", p, KIB4 * i), ("alloc", p, KIB4 * i),
                     ("free_requested", p, KIB4 * i), ("free_completed", p, KIB4 * i)]
    assert _trace(mem._snapshot()) == happened[-5:]


def test_stacks_all_adds_cpp_frames(recording):
    mem._record_memory_history(stacks="all")   # CUDA's default
    line = _line()
    x = _bytes(KIB4)
    (e,) = [e for e in mem._snapshot()["device_traces"][0] if e["action"] == "alloc"]
    names = [f["name"] for f in e["frames"]]
    # C++ frames first (innermost): the allocator's, then Python's down to this line.
    assert any("NeuronAllocator::allocate" in n for n in names)
    assert _where([f for f in e["frames"] if f["filename"].endswith(".py")]) == (
        os.path.basename(__file__), line, "test_stacks_all_adds_cpp_frames")
    del x


def test_state_only_and_disabling(recording):
    mem._record_memory_history("state", stacks="python")
    line = _line()
    x = _bytes(KIB8)
    snap = mem._snapshot()
    assert snap["device_traces"][0] == []     # "state": no history, only live blocks
    (seg,) = [s for s in snap["segments"] if s["address"] == x.data_ptr()]
    assert _where(seg["blocks"][0]["frames"])[1] == line
    mem._record_memory_history(None)
    y = _bytes(KIB8)
    del x
    snap = mem._snapshot()
    assert all(t == [] for t in snap["device_traces"])
    assert [s for s in snap["segments"] if s["blocks"][0]["state"] == "active_allocated"] == []
    del y


def test_context_none_and_skip_actions(recording):
    mem._record_memory_history(context=None, skip_actions=["segment_alloc", "free_requested"])
    x = _bytes(KIB4)
    p = x.data_ptr()
    del x
    snap = mem._snapshot()
    assert _trace(snap) == [("alloc", p, KIB4), ("free_completed", p, KIB4)]
    assert all(e["frames"] == [] for e in snap["device_traces"][0])


def test_devices_have_their_own_traces_and_segments(recording):
    mem._record_memory_history(stacks="python")
    x0, x1 = _bytes(KIB4, "neuron:0"), _bytes(KIB8, "neuron:1")
    snap = mem._snapshot()
    assert len(snap["device_traces"]) == torch.neuron.device_count()
    assert _trace(snap, 0) == [("segment_alloc", x0.data_ptr(), KIB4), ("alloc", x0.data_ptr(), KIB4)]
    assert _trace(snap, 1) == [("segment_alloc", x1.data_ptr(), KIB8), ("alloc", x1.data_ptr(), KIB8)]
    by_addr = {s["address"]: s["device"] for s in snap["segments"]}
    assert (by_addr[x0.data_ptr()], by_addr[x1.data_ptr()]) == (0, 1)
    del x0, x1


def test_other_threads_and_backward_record_without_deadlock(recording):
    mem._record_memory_history(stacks="python")
    out = []

    def worker():
        out.append(_bytes(KIB8 * 3))

    th = threading.Thread(target=worker)
    th.start()
    th.join(timeout=30)
    assert not th.is_alive()
    w = torch.randn(64, 64, device="neuron", requires_grad=True)
    (w @ w).sum().backward()
    torch.neuron.synchronize()
    snap = mem._snapshot()
    (e,) = [e for e in snap["device_traces"][0]
            if e["action"] == "alloc" and e["addr"] == out[0].data_ptr()]
    assert _where(e["frames"])[2] == "worker"
    assert w.grad is not None


def test_oom_is_recorded_with_its_line(recording):
    mem._record_memory_history(stacks="python")
    total = torch.neuron.get_device_properties(0).total_memory
    line = _line()
    with pytest.raises(torch.OutOfMemoryError):
        _bytes(total + 1)
    snap = mem._snapshot()
    (e,) = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
    assert (e["size"], e["device_free"]) == (total + 1, total - torch.neuron.memory_reserved(0))
    assert _where(e["frames"]) == (os.path.basename(__file__), line + 1, "test_oom_is_recorded_with_its_line")
    assert f"raise OutOfMemoryError # {_memory_viz.Bytes(total + 1)} requested" in _memory_viz.trace(snap)


def test_adopted_buffer_freed_behind_queued_work_completes_later(recording):
    mem._record_memory_history(stacks="python")
    a = torch.randn(1024, 1024, device="neuron")
    a @ a         # a signature's first launch runs synchronously; later ones are queued
    torch.neuron.synchronize()
    cpu = torch.empty(1000, dtype=torch.uint8)
    t = torch_neuronx._C._adopt_tensor(cpu, 0)   # a CPU kernel's output becomes device memory
    p = cpu.data_ptr()
    empty = torch_neuronx._C._adopt_tensor(torch.empty(0, dtype=torch.uint8), 0)
    del empty     # no memory: not shown (an address-0 segment would confuse the viewer)
    b = a @ a     # a 2-GFLOP matmul: the device is still busy when t goes
    del t
    pending = [s["blocks"][0]["state"] for s in mem._snapshot()["segments"] if s["address"] == p]
    torch.neuron.synchronize()
    torch.neuron.empty_cache()    # releases what the queue has passed
    assert pending == ["active_pending_free"]
    assert [(a_, s_) for a_, p_, s_ in _trace(mem._snapshot()) if p_ == p] == [
        ("segment_alloc", 1000), ("alloc", 1000), ("free_requested", 1000),
        ("free_completed", 1000), ("segment_free", 1000)]
    assert [e for e in _trace(mem._snapshot()) if e[2] == 0] == []
    del a, b


def test_bad_arguments_name_themselves():
    for kwargs, name in ((dict(enabled="everything"), "enabled"), (dict(context="some"), "context"),
                         (dict(stacks="cpp"), "stacks"), (dict(max_entries=-1), "max_entries"),
                         (dict(skip_actions=["allocate"]), "skip_actions")):
        with pytest.raises(ValueError, match=name):
            mem._record_memory_history(**kwargs)
    with pytest.raises(NotImplementedError, match="compile_context"):
        mem._record_memory_history(compile_context=True)


def test_explore_writes_a_snapshot_of_the_profile(tmp_path, capsys):
    cfg = NeuronConfig(profile_output_dir=str(tmp_path))
    handler = NeuronProfiler(cfg)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True, with_stack=True, experimental_config=cfg,
                                on_trace_ready=handler.export_trace) as prof:
        x = _bytes(MIB2)
        p = x.data_ptr()
        del x
        torch.neuron.synchronize()
    handler.close()
    trace_dir = tmp_path / "trace_0"
    _check_memory_rows_against_torch(trace_dir, prof, p)
    assert explore_main([str(trace_dir), "--json"]) == 0
    assert "memory_snapshot" in capsys.readouterr().out
    snap = pickle.loads((trace_dir / "memory_snapshot.pickle").read_bytes())
    t = [e for e in snap["device_traces"][0] if e["addr"] == p]
    assert [(e["action"], e["size"]) for e in t] == [
        ("alloc", MIB2), ("free_requested", MIB2), ("free_completed", MIB2)]
    (frame,) = t[0]["frames"]   # the op that allocated, at the test's source (with_stack=True)
    assert frame["name"].startswith("aten::") and os.path.basename(frame["filename"]) == \
        os.path.basename(__file__)
    assert _memory_viz.trace_plot(snap).lstrip().startswith("<!DOCTYPE html>")
    _memory_viz.segsum(snap)


def _check_memory_rows_against_torch(trace_dir, prof, p):
    """DeviceMemory's times are on SystemProfileEvents' clock and each row names the op it
    happened in: checked against torch's own FunctionEvents of the run."""
    import pyarrow.parquet as pq
    m = pq.read_table(str(trace_dir / "DeviceMemory.parquet")).to_pandas()
    ev = pq.read_table(str(trace_dir / "SystemProfileEvents.parquet")).to_pandas()
    fe = {e.id: e for e in prof.events()}
    mine = m[m.addr == p]
    assert list(mine.bytes) == [MIB2, -MIB2]
    alloc, free = mine.iloc[0], mine.iloc[1]
    op = fe[int(alloc.correlation_id)]      # the op torch timed around the allocation
    assert op.name == "aten::empty"
    row = ev[(ev.source == "framework") & (ev.correlation_id == alloc.correlation_id)].iloc[0]
    assert row.start_ns <= alloc.time_ns <= row.start_ns + row.duration_ns
    # start_ns is the FunctionEvents' clock shifted by one origin, shared by every row.
    origin_us = op.time_range.start - row.start_ns / 1e3
    other = ev[(ev.source == "framework") & (ev.correlation_id > 0)].iloc[-1]
    assert fe[int(other.correlation_id)].time_range.start == pytest.approx(
        origin_us + other.start_ns / 1e3, abs=2e-3)
    assert free.correlation_id == -1        # `del x` runs in no op
    assert free.time_ns > alloc.time_ns
