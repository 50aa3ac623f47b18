"""On-chip memory: address allocation with the target's per-partition capacity.

SBUF and PSUM are 2-D (partition x bytes). A tile occupies the same byte range in each of
its partitions; the allocator hands out byte ranges first-fit and frees them when the last
reference to the tile goes away. Addresses matter: the timing model tracks dependencies by
address, so reusing a freed range makes the new tile wait for the old one's readers.

A kernel may also place a tile itself (``nl.ndarray(..., address=(partition, byte))``, as
AWS's kernels do for their multi-buffering): such ranges may overlap each other (the
kernel's own reuse of a bank or buffer, serialised by the timing model through the shared
addresses), and automatic allocations keep clear of them while they live.
"""
from __future__ import annotations

import bisect

from .. import errors as E
from . import rules


class Allocator:
    def __init__(self, kind: str, capacity: int, bank_bytes: int | None = None, align: int = 4):
        self.kind, self.capacity, self.bank_bytes, self.align = kind, capacity, bank_bytes, align
        self.starts: list[int] = []          # sorted start addresses
        self.ends: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.peak = 0
        self.cursor = 0                      # next-fit: rotate through memory like a ring
        self.placed: dict[int, tuple[int, int, str]] = {}   # key -> (start, end, name)
        self._keys = 0

    def used(self) -> int:
        auto = sum(self.ends[s] - s for s in self.starts)
        if not self.placed:
            return auto
        covered, reach = 0, 0               # the placed ranges' union
        for lo, hi, _ in sorted(self.placed.values()):
            lo = max(lo, reach)
            if hi > lo:
                covered += hi - lo
            reach = max(reach, hi)
        return auto + covered

    def place(self, addr: int, nbytes: int, name: str, align: int) -> "_Placed":
        """A range the kernel chose itself, at a multiple of ``align`` (its dtype's size, as
        AWS's kernels align their own allocations); the returned handle frees it."""
        if addr < 0 or addr % align:
            rules.fail(E.UnsupportedError,
                       f"{self.kind.upper()} tile {name!r}: address byte offset {addr} must be "
                       f"a non-negative multiple of {align} (its dtype's size)")
        if addr + nbytes > self.capacity:
            cls = E.PsumCapacityError if self.kind == "psum" else E.SbufCapacityError
            rules.fail(cls, f"{self.kind.upper()} tile {name!r} placed at byte {addr} takes "
                            f"{nbytes} bytes per partition, past the {self.capacity} a "
                            f"partition holds")
        self._keys += 1
        self.placed[self._keys] = (addr, addr + nbytes, name)
        self.peak = max(self.peak, self.used())
        return _Placed(self, self._keys)

    def alloc(self, nbytes: int, name: str) -> int:
        nbytes = max(self.align, -(-nbytes // self.align) * self.align)
        addr = self._fit(nbytes)
        if addr is None:
            cls = E.PsumCapacityError if self.kind == "psum" else E.SbufCapacityError
            tiles = [(self.names[s], s, self.ends[s]) for s in self.starts]
            tiles += [(n, lo, hi) for lo, hi, n in self.placed.values()]
            live = ", ".join(f"{n}@{lo}:{hi - lo}B" for n, lo, hi in tiles[:12])
            rules.fail(cls, f"cannot allocate {nbytes} bytes per partition for {name!r} in "
                            f"{self.kind.upper()}: {self.used()} of {self.capacity} bytes per "
                            f"partition are live ({live}{', ...' if len(tiles) > 12 else ''})")
        bisect.insort(self.starts, addr)
        self.ends[addr], self.names[addr] = addr + nbytes, name
        self.peak = max(self.peak, self.used())
        return addr

    def _fit(self, n: int):
        # Next-fit from the last allocation, then first-fit from 0: freshly freed tiles are
        # reused last, so loop-local tiles rotate through buffers as the compiler's
        # multi-buffering does, instead of serialising on one address.
        taken = [(s, self.ends[s]) for s in self.starts]
        if self.placed:
            taken = sorted(taken + [(lo, hi) for lo, hi, _ in self.placed.values()])
        taken.append((self.capacity, self.capacity))
        for lo in (self.cursor, 0):
            cur = lo
            for s, e in taken:
                if e <= lo and s < self.capacity:
                    continue
                cand = self._bank_align(cur, n)
                if cand + n <= s:
                    self.cursor = cand + n
                    return cand
                if s < self.capacity:
                    cur = max(cur, e)
        return None

    def _bank_align(self, addr: int, n: int) -> int:
        # A PSUM tile that fits in one bank must not straddle two: matmul writes one bank.
        b = self.bank_bytes
        if b and n <= b and addr // b != (addr + n - 1) // b:
            return (addr // b + 1) * b
        if b and n > b and addr % b:
            return (addr // b + 1) * b
        return addr

    def free(self, addr: int):
        if addr in self.ends:
            self.starts.remove(addr)
            del self.ends[addr], self.names[addr]


class _Placed:
    """A placed range's handle: a buffer frees it as it frees an allocated one."""
    __slots__ = ("owner", "key")

    def __init__(self, owner: Allocator, key: int):
        self.owner, self.key = owner, key

    def free(self, _addr):
        self.owner.placed.pop(self.key, None)
