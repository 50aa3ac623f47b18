"""Modelled Trainium time of a collective on the profile's interconnect.

Execution never reads this module: the "neuron" process group moves the bytes with gloo over
TCP (host memory is device memory), and adds the time the same collective would take on the
chip's fabric to the device's modelled time (``torch_neuronx.modelled_time``).

The formulas are the textbook alpha-beta costs (alpha: per-step latency, beta: seconds per
byte), with S the bytes of the full buffer and p the number of ranks:

- all_reduce: the cheaper of a ring, 2(p-1)/p * S * beta + 2(p-1) * alpha, and a
  (double binary) tree, S * beta + 2 * ceil(log2 p) * alpha (bandwidth of a pipelined tree);
- all_gather (S = output) and reduce_scatter (S = input): (p-1)/p * S * beta + (p-1) * alpha;
- broadcast and reduce: pipelined tree, S * beta + ceil(log2 p) * alpha;
- all_to_all (S = input): (p-1)/p * S * beta + (p-1) * alpha;
- gather and scatter (S = the root's buffer): (p-1)/p * S * beta + (p-1) * alpha;
- send/recv: S * beta + alpha;  barrier: 2 * ceil(log2 p) * alpha.

Within an instance the link is NeuronLink; a rank gets its logical core's share of the chip's
NeuronLink bandwidth. Across instances (a group that spans several nodes) the collective is
hierarchical: a NeuronLink phase inside each node and an EFA phase between nodes on 1/local of
the data, where the node's EFA bandwidth is shared by its local ranks (they all send at once).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Callables told of every collective the "neuron" backend charges, as (device, op, nbytes,
# group_size, nodes, seconds): torch_neuronx.plan.trace records a step's collectives so a
# what-if can re-price them for another group size.
listeners: list = []

_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
        "gather", "scatter", "send", "recv", "barrier")


@dataclass(frozen=True)
class Link:
    """One level of the fabric: per-rank bandwidth (bytes/s) and per-step latency (s)."""
    bandwidth: float
    latency: float


def links(profile, lnc: int, local_ranks: int) -> tuple:
    """(NeuronLink, EFA) as seen by one rank of a node running ``local_ranks`` ranks."""
    cores = max(1, profile.physical_cores // max(1, lnc))
    neuronlink = Link(profile.neuronlink_bandwidth / cores, profile.neuronlink_latency_ns * 1e-9)
    efa = Link(profile.efa_bandwidth / max(1, local_ranks), profile.efa_latency_ns * 1e-9)
    return neuronlink, efa


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def _flat(op: str, nbytes: float, p: int, link: Link) -> float:
    """Time of ``op`` over ``p`` ranks joined by one kind of link."""
    if p <= 1 and op not in ("send", "recv"):
        return 0.0
    a, b = link.latency, 1.0 / link.bandwidth
    if op == "all_reduce":
        ring = 2 * (p - 1) / p * nbytes * b + 2 * (p - 1) * a
        tree = nbytes * b + 2 * _log2(p) * a
        return min(ring, tree)
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (p - 1) / p * nbytes * b + (p - 1) * a
    if op in ("broadcast", "reduce"):
        return nbytes * b + _log2(p) * a
    if op in ("send", "recv"):
        return nbytes * b + a
    if op == "barrier":
        return 2 * _log2(p) * a
    raise ValueError(f"collectives_model: unknown collective {op!r}; known: {', '.join(_OPS)}")


def collective_seconds(op: str, nbytes: float, group_size: int, nodes: int, profile, lnc: int) -> float:
    """Modelled seconds of collective ``op`` moving ``nbytes`` (see the module docstring for
    which buffer) among ``group_size`` ranks spread evenly over ``nodes`` instances."""
    nodes = max(1, min(nodes, group_size))
    local = max(1, math.ceil(group_size / nodes))
    neuronlink, efa = links(profile, lnc, local)
    if nodes == 1:
        return _flat(op, nbytes, group_size, neuronlink)
    if op == "all_reduce":
        # reduce-scatter in the node, all-reduce of 1/local across nodes, all-gather in the node
        return (_flat("reduce_scatter", nbytes, local, neuronlink)
                + _flat("all_reduce", nbytes / local, nodes, efa)
                + _flat("all_gather", nbytes, local, neuronlink))
    if op in ("all_gather", "reduce_scatter"):
        return (_flat(op, nbytes / nodes, local, neuronlink)
                + _flat(op, nbytes, nodes, Link(efa.bandwidth * local, efa.latency)) / local)
    if op in ("send", "recv"):
        # a peer on another node is the worst case; the caller does not say which
        return _flat(op, nbytes, 2, efa)
    # The remaining collectives are bound by the slower fabric for their cross-node part.
    return _flat(op, nbytes, local, neuronlink) + _flat(op, nbytes, nodes, efa)


def bus_bandwidth(op: str, nbytes: float, seconds: float, p: int) -> float:
    """nccl-tests' bus bandwidth (bytes/s) of a measured collective: algorithm bandwidth times
    the fraction of the data each rank must move."""
    if seconds <= 0:
        return float("inf")
    algbw = nbytes / seconds
    if op == "all_reduce":
        return algbw * 2 * (p - 1) / p
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return algbw * (p - 1) / p
    return algbw
