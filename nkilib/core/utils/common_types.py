"""Enumerations the kernels share, at AWS's module path (``nkilib.core.utils.common_types``).

Member names and values are AWS's, so configuration built against AWS's library selects the
same behaviour here; a kernel says which members it implements.
"""
from __future__ import annotations

from enum import Enum


class NormType(Enum):
    NO_NORM = 0
    RMS_NORM = 1
    LAYER_NORM = 2
    RMS_NORM_SKIP_GAMMA = 3      # RMSNorm without the weight (gamma) multiply


class ActFnType(Enum):
    SiLU = 0
    GELU = 1                     # exact (erf) GELU
    GELU_Tanh_Approx = 2
    Swish = 3                    # x * sigmoid(1.702 x), as AWS's reference defines it


class QuantizationType(Enum):
    NONE = 0
    STATIC = 1
    ROW = 2
    MX = 3
    STATIC_MX = 4
    ROW_MX = 5


class ExpertAffinityScaleMode(Enum):
    """When a token's expert outputs are scaled by its affinities (MoE kernels)."""
    NO_SCALE = 0
    POST_SCALE = 1
    PRE_SCALE = 2
    PRE_SCALE_DELAYED = 3


class RouterActFnType(Enum):
    """The router's activation (names, 'sigmoid' or 'softmax', and AWS's values 0 and 1 are
    accepted by the kernels too)."""
    SIGMOID = 0
    SOFTMAX = 1

    def __str__(self):
        return self.name.lower()


class MoEBlockIOLayout(Enum):
    """Token layouts of ``moe_block_tkg``'s input and output."""
    B_S_H = 0
    _128_Nprgs_Hfree_T = 1
