"""Errors the simulator raises when a kernel breaks a hardware or language rule.

Every rule error names the rule and the kernel's own ``file:line`` so the message points at
the user's code, not at the simulator.
"""
from __future__ import annotations


class NkiError(Exception):
    """Base of every NKI simulator error."""


class NkiRuleError(NkiError, ValueError):
    """A kernel broke a documented hardware or language rule."""

    rule = "nki-rule"

    def __init__(self, message: str, filename: str | None = None, lineno: int | None = None):
        self.filename, self.lineno, self.detail = filename, lineno, message
        where = f" (at {filename}:{lineno})" if filename else ""
        super().__init__(f"[{self.rule}] {message}{where}")


class PartitionDimensionError(NkiRuleError):
    rule = "partition-dim"


class PartitionAlignmentError(NkiRuleError):
    rule = "partition-start-alignment"


class SbufCapacityError(NkiRuleError, MemoryError):
    rule = "sbuf-capacity"


class PsumCapacityError(NkiRuleError, MemoryError):
    rule = "psum-capacity"


class PsumBankError(NkiRuleError):
    rule = "psum-bank"


class PsumAccumulateError(NkiRuleError):
    rule = "psum-accumulate"


class MatmulTileError(NkiRuleError):
    rule = "matmul-tile-size"


class MemoryLegalityError(NkiRuleError):
    rule = "engine-memory-access"


class DtypeLegalityError(NkiRuleError, TypeError):
    rule = "dtype"


class ShapeMismatchError(NkiRuleError):
    rule = "shape"


class IndexOutOfBoundsError(NkiRuleError, IndexError):
    rule = "index-bounds"


class OutputBufferError(NkiRuleError):
    rule = "kernel-output"


class UnsupportedError(NkiError, NotImplementedError):
    """An AWS NKI API this implementation does not provide (the message names it)."""


__all__ = [n for n in dir() if n.endswith("Error")]
