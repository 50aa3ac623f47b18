"""Neuron Explorer-style profiling: ``NeuronConfig``, ``ProfileMode``, ``NeuronProfiler``
(AWS's names) over ``torch.profiler``, with a Parquet export of host events and device
kernels. With the PrivateUse1 activity the Kineto plugin (csrc/profiler) records each kernel
(host execution on its queue, modelled Trainium time, the op that launched it); without it,
the device rows are the cost model's modelled intervals, uncorrelated."""
from __future__ import annotations

import enum
import os
import threading

from torch._C._profiler import _ExperimentalConfig

__all__ = ["NeuronConfig", "ProfileMode", "NeuronProfiler", "export_parquet",
           "PROFILE_SCHEMA_VERSION", "kernel_metadata"]

_PARQUET_NAMES = ("PROFILE_SCHEMA_VERSION", "SCHEMA", "export_parquet", "events_table")


def __getattr__(name):
    # pyarrow loads on first use: the Kineto plugin imports this package at every session start.
    if name in _PARQUET_NAMES:
        from . import _parquet
        return getattr(_parquet, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ProfileMode(enum.Enum):
    DEVICE = "device"
    RUNTIME = "runtime"
    CPU_UTIL = "cpu_util"
    HOST_MEMORY = "host_memory"


def _parse_cores(spec: str | None) -> set | None:
    """``"0,1,2-5"`` -> {0, 1, 2, 3, 4, 5}; None means every core."""
    if spec is None or spec == "":
        return None
    cores = set()
    for part in str(spec).split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cores.update(range(lo, hi + 1))
            else:
                cores.add(int(part))
        except ValueError:
            raise ValueError(f"capture_enabled_for_nc: bad core range {part!r} in {spec!r} "
                             f"(expected e.g. \"0,1,2-5\")") from None
    return cores


class NeuronConfig(_ExperimentalConfig):
    """``experimental_config`` for ``torch.profiler.profile`` on neuron. ``verbose`` is on so
    ``with_stack=True`` fills the per-event stack (the source line of each op)."""

    def __init__(self, modes=None, profile_output_dir=None, max_events_per_nc=None,
                 capture_enabled_for_nc=None, **kwargs):
        kwargs.setdefault("verbose", True)
        super().__init__(**kwargs)
        modes = list(modes) if modes is not None else [ProfileMode.DEVICE, ProfileMode.RUNTIME]
        for m in modes:
            if not isinstance(m, ProfileMode):
                raise TypeError(f"NeuronConfig: modes must be ProfileMode members, got {m!r}")
        self.modes = modes
        self.profile_output_dir = (profile_output_dir
                                   or os.environ.get("NEURON_RT_INSPECT_OUTPUT_DIR")
                                   or "./neuron_profile")
        if max_events_per_nc is not None and int(max_events_per_nc) <= 0:
            raise ValueError(f"NeuronConfig: max_events_per_nc must be > 0, got {max_events_per_nc}")
        self.max_events_per_nc = None if max_events_per_nc is None else int(max_events_per_nc)
        self.capture_enabled_for_nc = capture_enabled_for_nc
        self.cores = _parse_cores(capture_enabled_for_nc)


class NeuronProfiler:
    """Collects modelled device intervals while the profiler runs; ``export_trace`` is the
    ``on_trace_ready`` handler: chrome JSON plus a Parquet directory per trace."""

    def __init__(self, config: NeuronConfig | None = None):
        from .. import cost_model
        self.config = config or NeuronConfig()
        self._cost_model = cost_model
        self._device: list = []
        self._lock = threading.Lock()
        self._count = 0
        self._kernels: list = []  # NKI kernels' instruction rows (see _lanes)
        from . import _lanes
        self._lanes = _lanes
        _lanes._start(self._kernels)
        cost_model._drain()  # work queued before profiling is not this trace's
        cost_model._listeners.append(self._on_interval)

    def _on_interval(self, iv) -> None:
        cfg = self.config
        if cfg.cores is not None and iv[0] not in cfg.cores:
            return
        with self._lock:
            if cfg.max_events_per_nc is not None and \
                    sum(1 for d in self._device if d[0] == iv[0]) >= cfg.max_events_per_nc:
                return
            self._device.append(iv)

    def close(self) -> None:
        self._lanes._stop(self._kernels)
        if self._on_interval in self._cost_model._listeners:
            self._cost_model._listeners.remove(self._on_interval)

    def export_trace(self, prof) -> str:
        """Writes ``<dir>/trace_<n>.json`` and ``<dir>/trace_<n>/*.parquet``; returns the
        Parquet directory."""
        self._cost_model._drain()
        out = self.config.profile_output_dir
        os.makedirs(out, exist_ok=True)
        n = self._count
        self._count += 1
        with self._lock:
            device, self._device = self._device, []
            kernels, self._kernels[:] = list(self._kernels), []
        path = os.path.join(out, f"trace_{n}")
        from ._allocations import allocations
        from ._parquet import export_parquet
        file = os.path.join(out, f"trace_{n}.json")
        trace = _chrome_trace(prof, file)
        table = export_parquet(path, host_events=prof.events(), device_events=device,
                               kernel_meta=_kernel_args(trace), cores=self.config.cores,
                               max_per_device=self.config.max_events_per_nc,
                               allocs=allocations(prof))
        from ._parquet import instructions_table, pq
        rows = _add_lanes(trace, table, file, kernels)
        pq.write_table(instructions_table(rows), os.path.join(path, "DeviceInstructions.parquet"))
        return path


def _chrome_trace(prof, file: str) -> dict:
    import json
    prof.export_chrome_trace(file)
    with open(file) as f:
        return json.load(f)


def _kernel_args(trace: dict) -> dict:
    """The Kineto plugin's metadata of each kernel (modelled_ns, engine, flops, hbm_bytes,
    stream, launch), by the kernel's correlation id (its FunctionEvent's ``id``)."""
    return {e["args"]["correlation"]: e["args"] for e in trace["traceEvents"]
            if e.get("cat") == "kernel" and "correlation" in e.get("args", {})}


def kernel_metadata(prof) -> dict:
    """``{kernel event id: metadata}`` of a finished ``torch.profiler.profile`` run with the
    PrivateUse1 activity. torch's FunctionEvents drop a device event's metadata; Kineto keeps
    it in the chrome trace, which this exports to a temporary file and reads."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        return _kernel_args(_chrome_trace(prof, os.path.join(d, "trace.json")))


# Modelled lanes of these engines get a thread of their own beside the device's queues.
_ENGINE_LANES = {"nki": 1000, "fused": 1001, "collective": 1002}


def _add_lanes(trace: dict, table, file: str, kernels=()) -> list:
    """Kineto's chrome trace (with the plugin's ``kernel`` events, host execution time) plus
    the modelled Trainium timeline: one process per device, one thread per queue (and per
    engine for NKI kernels, compiled graphs and collectives, and per TensorE/VectorE/ScalarE/
    GpSimd/DMA queue for NKI kernels' instructions). Returns the DeviceInstructions rows. Modelled events have
    ``cat: "modelled_kernel"`` and ``args.queue`` (not ``stream``), so tools that read device
    kernels by stream (Holistic Trace Analysis) count each kernel once."""
    import json

    import pyarrow.compute as pa_compute
    events = trace["traceEvents"]
    host_ts = [e["ts"] for e in events if e.get("ph") == "X" and e.get("cat") != "kernel"]
    origin = min(host_ts) if host_ts else 0.0
    hw = table.filter(pa_compute.equal(table["source"], "hardware")).to_pydict()
    lanes = set()
    nki_rows = []
    for i, d, q, eng, name, start, dur, corr in zip(hw["event_id"], hw["device"], hw["queue"],
                                                    hw["engine"], hw["name"],
                                                    hw["modelled_start_ns"], hw["modelled_ns"],
                                                    hw["correlation_id"]):
        tid = _ENGINE_LANES.get(eng, q)
        lanes.add((d, tid, eng if tid != q else f"queue {q}"))
        events.append({"ph": "X", "cat": "modelled_kernel", "name": name, "pid": 1000 + d,
                       "tid": tid, "ts": origin + start / 1e3, "dur": dur / 1e3,
                       "args": {"queue": q, "device": d, "engine": eng, "modelled_ns": dur,
                                "External id": corr}})
        if eng in ("nki", "fused"):
            nki_rows.append((i, d, name, start, dur, corr))
    from ._lanes import _trace_events
    inner, inner_lanes, rows = _trace_events(nki_rows, kernels, origin)
    events.extend(inner)
    lanes |= inner_lanes
    for d in sorted({lane[0] for lane in lanes}):
        events.append({"ph": "M", "name": "process_name", "pid": 1000 + d,
                       "args": {"name": f"neuron:{d} modelled Trainium time"}})
    for d, tid, label in sorted(lanes):
        events.append({"ph": "M", "name": "thread_name", "pid": 1000 + d, "tid": tid,
                       "args": {"name": label}})
    with open(file, "w") as f:
        json.dump(trace, f)
    return rows



def _start_from_env() -> None:
    """``NEURON_RT_INSPECT_ENABLE=1``: profile the whole process of an unchanged script and
    export at exit into ``$NEURON_RT_INSPECT_OUTPUT_DIR`` (default ./neuron_profile).
    Without stacks: this starts while ``import torch`` runs, and torch 2.13 then fails to
    decode the names of the python_function events of half-imported modules."""
    import atexit

    import torch
    cfg = NeuronConfig()
    handler = NeuronProfiler(cfg)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.PrivateUse1],
                                  with_stack=False,
                                  experimental_config=cfg, on_trace_ready=handler.export_trace)
    prof.start()

    def _stop():
        prof.stop()
        handler.close()
    atexit.register(_stop)
