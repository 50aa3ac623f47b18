"""A cluster of Trainium chips: the chip profile, how many chips NeuronLink joins into one
node, and the EFA bandwidth between nodes.

Figures (bytes/s from AWS's Gbps): trn1.32xlarge, 16 Trainium chips on NeuronLink-v2, 800 Gbps
EFA (AWS "Trn1/Trn1n Architecture" page); trn2.48xlarge, 16 Trainium2 chips in a 4x4 torus,
3.2 Tbps EFAv3; a Trn2 UltraServer joins four trn2.48xlarge by NeuronLink into 64 chips (AWS
Trn2 announcement); a Trn3 UltraServer joins 144 Trainium3 chips (AWS Trn3 announcement;
between UltraServers the profile's EFA figure, AWS publishes none for Trn3). Chip numbers
(FLOPS, HBM, NeuronLink per chip) come from ``neuronhw``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from neuronhw import get_profile
from neuronhw.profile import ChipProfile


@dataclass(frozen=True)
class Cluster:
    name: str
    profile: ChipProfile
    chips: int
    chips_per_node: int      # chips NeuronLink joins (an instance or an UltraServer)
    lnc: int                 # logical NeuronCore config: physical cores per device
    efa_bandwidth: float     # bytes/s per node, between nodes

    @property
    def devices_per_chip(self) -> int:
        return self.profile.logical_cores(self.lnc)

    @property
    def devices(self) -> int:
        return self.chips * self.devices_per_chip

    @property
    def devices_per_node(self) -> int:
        return min(self.chips, self.chips_per_node) * self.devices_per_chip

    @property
    def nodes(self) -> int:
        return -(-self.chips // self.chips_per_node)

    @property
    def fabric(self) -> ChipProfile:
        """The profile with this cluster's EFA bandwidth (what the collective model reads)."""
        return dataclasses.replace(self.profile, efa_bandwidth=self.efa_bandwidth)


# name -> (chip, chips per node, EFA bytes/s per node)
INSTANCES = {
    "trn1.32xlarge": ("trn1", 16, 800e9 / 8),
    "trn2.48xlarge": ("trn2", 16, 3.2e12 / 8),
    "trn2-ultraserver": ("trn2", 64, 4 * 3.2e12 / 8),
    "trn3-ultraserver": ("trn3", 144, None),
}


def cluster(name: str = "trn2.48xlarge", chips: int | None = None, lnc: int | None = None) -> Cluster:
    """``chips`` Trainium chips of instance type ``name`` (one node's worth by default)."""
    if name not in INSTANCES:
        raise ValueError(f"unknown instance type {name!r}; known: {', '.join(INSTANCES)}")
    chip, per_node, efa = INSTANCES[name]
    profile = get_profile(chip)
    chips = per_node if chips is None else chips
    if chips < 1:
        raise ValueError(f"a cluster needs at least one chip, got {chips}")
    if chips > per_node and chips % per_node:
        raise ValueError(f"{chips} chips of {name}: more than one node must be whole nodes "
                         f"of {per_node} chips")
    lnc = profile.default_lnc if lnc is None else lnc
    if profile.physical_cores % lnc or (lnc > 1 and not profile.supports_lnc2):
        raise ValueError(f"LNC={lnc} is not a logical core configuration of {profile.chip}")
    return Cluster(name, profile, chips, per_node, lnc, efa if efa is not None else profile.efa_bandwidth)
