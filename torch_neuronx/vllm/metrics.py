"""Modelled Trainium serving cost: TTFT, inter-token latency and tokens/s per chip.

Each engine step's modelled time is what the cost model charged the device for it (the
model's ops, attention as NKI-lib's ``attention_cte``/``attention_tkg`` kernels, the
sampler). A request's modelled TTFT is the modelled time of the steps from its first
scheduling to the step that samples its first token (queueing excluded); a decode step's
modelled time is the inter-token latency of every request it advances. Tokens per second
per chip assume the chip's logical cores serve as many replicas as fit: one per core, or one
per ``tensor_parallel_size`` cores under tensor parallelism.

Under tensor parallelism every worker keeps its own summary (its device's ops and its share
of the collectives, which keep the workers in step); only the first worker of the group
logs and feeds ``/metrics``, so one replica's series are counted once.

The numbers go to the log (logger ``vllm.neuron``, under vLLM's own) every ``LOG_EVERY``
seconds of wall time, to ``summary()``, and, when ``PROMETHEUS_MULTIPROC_DIR`` is set, to
vLLM's ``/metrics`` as ``neuron:modelled_*`` series.

A diffusion request (vLLM-Omni) is one call of the diffusion worker: text encoding, every
denoising step and the VAE decode. Its modelled time is what the cost model charged for that
call (``RequestClock``); requests batched into one call each take the call's time.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch_neuronx

from . import LOGGER

log = logging.getLogger(LOGGER)
LOG_EVERY = float(os.environ.get("TORCH_NEURONX_VLLM_LOG_EVERY", "10"))


@dataclass
class Summary:
    platform: str
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0                               # modelled, all steps
    ttft: list = field(default_factory=list)           # modelled seconds per request
    itl: list = field(default_factory=list)            # modelled seconds per decode step
    cores_per_chip: int = 1
    device: str = ""
    tensor_parallel_size: int = 1
    collective_seconds: float = 0.0                    # modelled, part of ``seconds``
    collectives: dict = field(default_factory=dict)    # "c10d::<op>" -> modelled seconds
    by_op: dict = field(default_factory=dict)          # op or kernel -> modelled seconds

    @property
    def replicas_per_chip(self) -> float:
        tp, cores = self.tensor_parallel_size, self.cores_per_chip
        # a group wider than a chip is a fraction of a replica per chip
        return cores // tp if tp <= cores else cores / tp

    @property
    def tokens_per_s_per_chip(self) -> float:
        return self.tokens / self.seconds * self.replicas_per_chip if self.seconds else 0.0

    def as_dict(self) -> dict:
        med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
        return {"platform": self.platform, "steps": self.steps, "tokens": self.tokens,
                "modelled_seconds": self.seconds, "ttft_median_s": med(self.ttft),
                "itl_median_s": med(self.itl), "requests": len(self.ttft),
                "tokens_per_s_per_chip": self.tokens_per_s_per_chip, "device": self.device,
                "tensor_parallel_size": self.tensor_parallel_size,
                "collective_seconds": self.collective_seconds,
                "collectives": dict(self.collectives), "by_op": dict(self.by_op)}

    def __str__(self):
        d = self.as_dict()
        return (f"neuron modelled {d['platform']}: TTFT median {d['ttft_median_s'] * 1e3:.3f} "
                f"ms over {d['requests']} requests, ITL median {d['itl_median_s'] * 1e3:.3f} "
                f"ms, {d['tokens_per_s_per_chip']:.0f} tokens/s per chip "
                f"({d['tokens']} tokens in {d['steps']} steps)")


class _Clock:
    """A device's modelled clock, read per serving step or request."""
    device: torch.device

    def begin(self) -> None:
        """A step or call starts: what ran before it (profiling, loading, warm-up) is not
        its time."""
        torch.neuron.synchronize(self.device)
        torch_neuronx.reset_modelled_time(self.device)


class StepClock(_Clock):
    """Reads the modelled time of every engine step of one device."""

    def __init__(self, device: torch.device, tensor_parallel_size: int = 1,
                 publish: bool = True):
        """``publish``: log and feed ``/metrics`` (the first worker of a tensor-parallel
        group; the others would count the same tokens again)."""
        self.device = device
        self.tensor_parallel_size = tensor_parallel_size
        self.publish = publish
        self.reset()
        self._prefill: dict = {}      # req id -> [modelled seconds so far, prompt tokens left]
        self._step = None
        self._last_log = time.monotonic()
        self._prom = _prometheus() if publish else None

    def reset(self) -> None:
        """Start a new summary (the requests in flight keep their prefill time so far)."""
        cfg = torch_neuronx._state.config()
        self.summary = Summary(platform=cfg.profile.name,
                               cores_per_chip=cfg.profile.logical_cores(cfg.lnc),
                               device=str(self.device),
                               tensor_parallel_size=self.tensor_parallel_size)

    def step(self, scheduler_output) -> None:
        """Remember which requests a step advances (its time is read once it sampled)."""
        new, first_tokens, decodes = scheduler_output.num_scheduled_tokens, [], 0
        for req in scheduler_output.scheduled_new_reqs:
            left = len(req.prompt_token_ids or ()) - req.num_computed_tokens
            self._prefill[req.req_id] = [0.0, left]
        for rid in scheduler_output.finished_req_ids:
            self._prefill.pop(rid, None)
        for rid, n in new.items():
            state = self._prefill.get(rid)
            if state is None:
                decodes += 1
                continue
            state[1] -= n
            if state[1] <= 0:
                first_tokens.append(rid)
        self._step = (first_tokens, decodes, list(self._prefill))

    def sampled(self) -> None:
        if self._step is None:
            return
        first_tokens, decodes, prefilling = self._step
        self._step = None
        torch.neuron.synchronize(self.device)
        t = torch_neuronx.modelled_time(self.device, reset=True)
        seconds = t.seconds
        s = self.summary
        s.steps += 1
        s.seconds += seconds
        s.collective_seconds += t.by_engine.get("collective", 0.0)
        _add_ops(s.by_op, t)
        for op, sec in t.by_op.items():
            if op.startswith("c10d::"):
                s.collectives[op] = s.collectives.get(op, 0.0) + sec
        s.tokens += len(first_tokens) + decodes
        for rid in prefilling:
            self._prefill[rid][0] += seconds
        for rid in first_tokens:
            s.ttft.append(self._prefill.pop(rid)[0])
        if decodes:
            s.itl.append(seconds)
        if self._prom is not None:
            self._prom(s, seconds, first_tokens, decodes)
        now = time.monotonic()
        if self.publish and now - self._last_log >= LOG_EVERY:
            self._last_log = now
            log.info("%s", s)


def _add_ops(by_op: dict, t) -> None:
    for op, sec in t.by_op.items():
        by_op[op] = by_op.get(op, 0.0) + sec


@dataclass
class DiffusionSummary:
    platform: str
    device: str = ""
    seconds: float = 0.0                               # modelled, all calls
    request_seconds: list = field(default_factory=list)  # modelled seconds per request
    by_op: dict = field(default_factory=dict)          # op or kernel -> modelled seconds

    def as_dict(self) -> dict:
        xs = self.request_seconds
        return {"platform": self.platform, "device": self.device,
                "modelled_seconds": self.seconds, "requests": len(xs),
                "request_median_s": statistics.median(xs) if xs else 0.0,
                "request_seconds": list(xs), "by_op": dict(self.by_op)}

    def __str__(self):
        d = self.as_dict()
        return (f"neuron modelled {d['platform']}: diffusion request median "
                f"{d['request_median_s'] * 1e3:.3f} ms over {d['requests']} requests")


class RequestClock(_Clock):
    """Reads the modelled time of every diffusion worker call of one device."""

    def __init__(self, device: torch.device, publish: bool = True):
        """``publish``: log each request and feed ``/metrics`` (the first worker of a parallel
        group)."""
        self.device = device
        self.publish = publish
        self.reset()
        self._prom = _prometheus_diffusion() if publish else None

    def reset(self) -> None:
        self.summary = DiffusionSummary(platform=torch_neuronx._state.config().profile.name,
                                        device=str(self.device))

    def end(self, requests: int) -> None:
        """A call of ``requests`` requests ended (0: one denoising step of requests that go on)."""
        torch.neuron.synchronize(self.device)
        t = torch_neuronx.modelled_time(self.device, reset=True)
        s = self.summary
        s.seconds += t.seconds
        _add_ops(s.by_op, t)
        s.request_seconds.extend([t.seconds] * requests)
        if self._prom is not None:
            self._prom(t.seconds, requests)
        if self.publish and requests:
            log.info("neuron modelled %s: diffusion request %.3f ms (median %.3f ms over %d "
                     "requests)", s.platform, t.seconds * 1e3,
                     statistics.median(s.request_seconds) * 1e3, len(s.request_seconds))


def _prometheus():
    """Gauges in vLLM's multiprocess Prometheus registry, or None without one: the engine
    runs in its own process, and only the multiprocess registry carries its series to the
    API server's ``/metrics``."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    from prometheus_client import Counter, Gauge, Histogram

    plat = torch_neuronx._state.config().profile.name
    buckets = [1e-5 * 2 ** i for i in range(20)]
    ttft = Histogram("neuron:modelled_time_to_first_token_seconds",
                     "Modelled Trainium time to first token per request", ["platform"],
                     buckets=buckets).labels(plat)
    itl = Histogram("neuron:modelled_inter_token_latency_seconds",
                    "Modelled Trainium time of each decode step", ["platform"],
                    buckets=buckets).labels(plat)
    busy = Counter("neuron:modelled_busy_seconds", "Modelled Trainium time of all steps",
                   ["platform"]).labels(plat)
    tokens = Counter("neuron:modelled_tokens", "Tokens produced by modelled steps",
                     ["platform"]).labels(plat)
    rate = Gauge("neuron:modelled_tokens_per_second_per_chip",
                 "Tokens per modelled second, times the chip's logical cores",
                 ["platform"], multiprocess_mode="mostrecent").labels(plat)

    def update(s: Summary, seconds: float, first_tokens: list, decodes: int) -> None:
        for t in s.ttft[len(s.ttft) - len(first_tokens):]:
            ttft.observe(t)
        if decodes:
            itl.observe(seconds)
        busy.inc(seconds)
        tokens.inc(len(first_tokens) + decodes)
        rate.set(s.tokens_per_s_per_chip)
    return update


def _prometheus_diffusion():
    """The diffusion worker's series in vLLM's multiprocess Prometheus registry (Omni's API
    server exposes it at ``/metrics``), or None without one."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    from prometheus_client import Counter, Histogram

    plat = torch_neuronx._state.config().profile.name
    request = Histogram("neuron:modelled_diffusion_request_seconds",
                        "Modelled Trainium time of each diffusion request", ["platform"],
                        buckets=[1e-4 * 2 ** i for i in range(24)]).labels(plat)
    busy = Counter("neuron:modelled_diffusion_busy_seconds",
                   "Modelled Trainium time of all diffusion worker calls",
                   ["platform"]).labels(plat)

    def update(seconds: float, requests: int) -> None:
        busy.inc(seconds)
        for _ in range(requests):
            request.observe(seconds)
    return update
