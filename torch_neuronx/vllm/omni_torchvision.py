"""Lets PyPI's torchvision 0.28 import beside the CPU torch wheel in ``.venv-omni``.

PyPI's Linux torchvision wheel is the CUDA build: its ``_C`` needs ``libtorch_cuda.so``, so
with the CPU torch it does not load, and ``torchvision/_meta_registrations.py`` then fails at
import on the two fake-kernel registrations it does not guard (``torchvision::nms`` and
``torchvision::qnms`` must exist). vLLM 0.30 imports torchvision through Transformers'
Qwen2-VL image processor whenever vLLM-Omni's ``Omni`` is imported. Defining the two
schemas (no kernels) lets torchvision's pure-Python parts import; calling either op still
fails with torch's "could not run 'torchvision::nms'" error, nothing runs silently.

``make omni-setup`` installs a ``.pth`` line calling ``install()`` in every interpreter of
that venv; the schemas are defined only when torchvision reaches its meta registrations
(torch is imported by then; the hook leaves nothing else to run).
"""
from __future__ import annotations

import importlib.abc
import sys

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_lib = None


def _define_schemas() -> None:
    global _lib
    import torch

    if _lib is not None or hasattr(torch.ops.torchvision, "nms"):
        return
    _lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        _lib.define(schema)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision._meta_registrations":
            sys.meta_path.remove(self)
            _define_schemas()
        return None


def install() -> None:
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
