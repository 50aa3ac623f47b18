"""The configuration read at start-up (kept here so every module sees the same one)."""
from __future__ import annotations

from .runtime import config as _config

_CONFIG = None


def config() -> _config.Config:
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = _config.read()
    return _CONFIG
