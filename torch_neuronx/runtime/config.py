"""Which virtual NeuronCores exist, read once from the environment as AWS's runtime does.

- ``NEURON_PLATFORM_TARGET_OVERRIDE``: trn1 | trn2 | trn3 (default trn2).
- ``NEURON_LOGICAL_NC_CONFIG``: 1 or 2 physical cores per logical core (trn2/trn3 default 2).
- ``NEURON_RT_VISIBLE_CORES``: logical core ids, e.g. ``0-3`` or ``0,2``; or
  ``NEURON_RT_NUM_CORES``: how many. Default: every logical core of one chip.
- ``TORCH_NEURONX_HBM_BYTES``: modelled HBM per device (e.g. ``512MiB``), for tests.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from neuronhw import ChipProfile, get_profile

_MAX_CHIPS = 16  # a trn2.48xlarge / trn3 UltraServer node holds 16 chips
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40,
          "tib": 1 << 40}


@dataclass(frozen=True)
class Config:
    profile: ChipProfile
    lnc: int
    cores: tuple          # visible logical core ids; device index i is cores[i]
    hbm_bytes: int        # modelled HBM per device

    @property
    def device_count(self) -> int:
        return len(self.cores)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a byte size from {text!r} (e.g. 512MiB, 2GiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_cores(text: str, limit: int) -> tuple:
    cores = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"NEURON_RT_VISIBLE_CORES={text!r}: expected ids like '0-3' or '0,2'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"NEURON_RT_VISIBLE_CORES={text!r}: range {part} is empty")
        cores.extend(range(lo, hi + 1))
    if not cores:
        raise ValueError("NEURON_RT_VISIBLE_CORES is set but names no core")
    if max(cores) >= limit:
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={text!r}: core {max(cores)} does not exist "
                         f"(at most {limit} logical cores)")
    return tuple(dict.fromkeys(cores))


def read(env=os.environ) -> Config:
    profile = get_profile(env.get("NEURON_PLATFORM_TARGET_OVERRIDE"))
    lnc_text = env.get("NEURON_LOGICAL_NC_CONFIG")
    lnc = int(lnc_text) if lnc_text else profile.default_lnc
    if lnc not in (1, 2) or (lnc == 2 and not profile.supports_lnc2):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={lnc_text}: {profile.chip} supports "
                         f"{'1 or 2' if profile.supports_lnc2 else 'only 1'}")
    per_chip = profile.logical_cores(lnc)
    limit = per_chip * _MAX_CHIPS
    if env.get("NEURON_RT_VISIBLE_CORES"):
        cores = _parse_cores(env["NEURON_RT_VISIBLE_CORES"], limit)
    elif env.get("NEURON_RT_NUM_CORES"):
        n = int(env["NEURON_RT_NUM_CORES"])
        if not 0 <= n <= limit:
            raise ValueError(f"NEURON_RT_NUM_CORES={n}: between 0 and {limit}")
        cores = tuple(range(n))
    else:
        cores = tuple(range(per_chip))
    hbm = env.get("TORCH_NEURONX_HBM_BYTES")
    hbm_bytes = parse_bytes(hbm) if hbm else profile.core_hbm_bytes(lnc)
    return Config(profile=profile, lnc=lnc, cores=cores, hbm_bytes=hbm_bytes)
