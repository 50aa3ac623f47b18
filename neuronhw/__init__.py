"""Hardware profiles of the Trainium chips, selected as AWS does.

``NEURON_PLATFORM_TARGET_OVERRIDE`` names the chip (trn2 by default); NKI's target names
(gen2/gen3/gen4) are accepted too.
"""
from __future__ import annotations

import os

from .profile import ChipProfile
from .trn1 import TRN1
from .trn2 import TRN2
from .trn3 import TRN3

PROFILES = {p.name: p for p in (TRN1, TRN2, TRN3)}
_ALIASES = {"gen2": "trn1", "gen3": "trn2", "gen4": "trn3",
            "trn1n": "trn1", "trn2n": "trn2", "inf2": "trn1"}


def get_profile(name: str | None = None) -> ChipProfile:
    """The profile for a chip name, or the one the environment selects."""
    if name is None:
        name = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in PROFILES:
        raise ValueError(
            f"unknown Neuron platform target {name!r} "
            f"(NEURON_PLATFORM_TARGET_OVERRIDE accepts {', '.join(sorted(PROFILES) + sorted(_ALIASES))})")
    return PROFILES[key]


__all__ = ["ChipProfile", "PROFILES", "get_profile", "TRN1", "TRN2", "TRN3"]
