"""Hardware rules and how a violation is reported.

A violation raises an ``NkiRuleError`` subclass whose message ends with the file and line of
the innermost frame outside the ``nki`` package: the kernel line that broke the rule.
"""
from __future__ import annotations

import os
import sys

from .. import errors as E

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_EXAMPLES = os.path.join(_PKG_DIR, "examples") + os.sep


def user_location():
    """(filename, lineno) of the kernel code that called into the simulator."""
    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_PKG_DIR) or fn.startswith(_EXAMPLES):
            return fn, f.f_lineno
        f = f.f_back
    return None, None


def fail(cls, message: str):
    fn, ln = user_location()
    raise cls(message, fn, ln)


# Engines and the on-chip buffers they may touch (AWS arch guide: GpSimd cannot access
# PSUM; TensorE reads SBUF and writes PSUM; DMA moves between HBM and SBUF).
ENGINE_READS = {
    "tensor": {"sbuf"},
    "vector": {"sbuf", "psum"},
    "scalar": {"sbuf", "psum"},
    "gpsimd": {"sbuf"},
    "dma": {"sbuf", "hbm"},
}
ENGINE_WRITES = {
    "tensor": {"psum"},
    "vector": {"sbuf", "psum"},
    "scalar": {"sbuf", "psum"},
    "gpsimd": {"sbuf"},
    "dma": {"sbuf", "hbm"},
}
ENGINE_NAMES = {"tensor": "TensorE", "vector": "VectorE", "scalar": "ScalarE",
                "gpsimd": "GpSimd", "dma": "DMA"}


def check_access(instr: str, engine: str, reads, writes):
    for t in reads:
        if t.kind not in ENGINE_READS[engine]:
            fail(E.MemoryLegalityError,
                 f"{instr}: {ENGINE_NAMES[engine]} cannot read {t.kind.upper()} "
                 f"(input {t.name!r} lives in {t.kind.upper()}; it may read "
                 f"{'/'.join(sorted(k.upper() for k in ENGINE_READS[engine]))})")
    for t in writes:
        if t.kind not in ENGINE_WRITES[engine]:
            fail(E.MemoryLegalityError,
                 f"{instr}: {ENGINE_NAMES[engine]} cannot write {t.kind.upper()} "
                 f"(output {t.name!r} lives in {t.kind.upper()}; it may write "
                 f"{'/'.join(sorted(k.upper() for k in ENGINE_WRITES[engine]))})")


def check_partitions(instr: str, engine: str, tensors, pmax: int):
    """Compute engines address 128 partitions in quadrants of 32: an access starts at
    partition 0, 32, 64 or 96 and may not run past the end of its quadrant group."""
    for t in tensors:
        if t.kind == "hbm":
            continue
        p0, n = t.pstart, t.shape[0] if t.shape else 1
        if n > pmax:
            fail(E.PartitionDimensionError,
                 f"{instr}: {t.name!r} spans {n} partitions; the partition dimension "
                 f"(first axis) is at most {pmax}")
        if engine == "dma":
            continue
        if p0 % 32:
            fail(E.PartitionAlignmentError,
                 f"{instr}: access to {t.name!r} starts at partition {p0}; compute engines "
                 f"start at partition 0, 32, 64 or 96")
        limit = {0: 128, 32: 32, 64: 64, 96: 32}[p0]
        if n > limit:
            fail(E.PartitionAlignmentError,
                 f"{instr}: access to {t.name!r} starts at partition {p0} and spans {n} "
                 f"partitions; from partition {p0} at most {limit} may be accessed")


def same_shape(instr, a, b, what="shape"):
    if tuple(a.shape) != tuple(b.shape):
        fail(E.ShapeMismatchError, f"{instr}: {what} mismatch {tuple(a.shape)} vs {tuple(b.shape)}")


def same_elems(instr, a, b):
    """Same partitions and the same number of elements per partition."""
    if a.shape[0] != b.shape[0] or a.free_size != b.free_size:
        fail(E.ShapeMismatchError,
             f"{instr}: {a.name!r} {tuple(a.shape)} and {b.name!r} {tuple(b.shape)} must have "
             f"the same partition size and elements per partition")


def require_float(instr, t, what):
    if not t.dtype.is_float:
        fail(E.DtypeLegalityError, f"{instr}: {what} must be a float dtype, got {t.dtype.name}")
