"""On-chip memory: address allocation with the target's per-partition capacity.

SBUF and PSUM are 2-D (partition x bytes). A tile occupies the same byte range in each of
its partitions; the allocator hands out byte ranges first-fit and frees them when the last
reference to the tile goes away. Addresses matter: the timing model tracks dependencies by
address, so reusing a freed range makes the new tile wait for the old one's readers.
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

    def used(self) -> int:
        return sum(self.ends[s] - s for s in self.starts)

    def alloc(self, nbytes: int, name: str) -> int:
        nbytes = max(self.align, -(-nbytes // self.align) * self.align)
        addr = self._fit(nbytes)
        if addr is None:
            cls = E.PsumCapacityError if self.kind == "psum" else E.SbufCapacityError
            live = ", ".join(f"{self.names[s]}@{s}:{self.ends[s] - s}B" for s in self.starts[:12])
            rules.fail(cls, f"cannot allocate {nbytes} bytes per partition for {name!r} in "
                            f"{self.kind.upper()}: {self.used()} of {self.capacity} bytes per "
                            f"partition are live ({live}{', ...' if len(self.starts) > 12 else ''})")
        bisect.insort(self.starts, addr)
        self.ends[addr], self.names[addr] = addr + nbytes, name
        self.peak = max(self.peak, self.used())
        return addr

    def _fit(self, n: int):
        # Next-fit from the last allocation, then first-fit from 0: freshly freed tiles are
        # reused last, so loop-local tiles rotate through buffers as the compiler's
        # multi-buffering does, instead of serialising on one address.
        for lo in (self.cursor, 0):
            cur = lo
            for s in self.starts + [self.capacity]:
                if s + (self.ends.get(s, s) - s) <= lo and s < self.capacity:
                    continue
                cand = self._bank_align(cur, n)
                if cand + n <= s:
                    self.cursor = cand + n
                    return cand
                if s < self.capacity:
                    cur = max(cur, self.ends[s])
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
