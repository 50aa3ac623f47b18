"""The peer agreement: before each collective, every rank of a group agrees on a fingerprint
of its call (op, dtype, shape, root, reduce op), so ranks that disagree get the same clear
error naming each rank's call instead of a hang or gloo's size assertion (which can kill a
rank). It runs through shared memory when every rank of the group is on this host
(``shm_agreement``), else (or with ``TORCH_NEURONX_DIST_CHECK=gloo``) as a 16-byte gloo
all-reduce; ``TORCH_NEURONX_DIST_CHECK=0`` turns it off. A rank that dies or never arrives
surfaces as an error on the survivors within the group's timeout, naming op, rank and group.
"""
from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from . import shm_agreement

_FINGERPRINTS: dict = {}   # call description -> its 56-bit hash


class PeerAgreement:
    """One process group's agreement; ``transport`` is "off", "shm" or "gloo"."""

    def __init__(self, pg):
        self._pg = pg
        mode = os.environ.get("TORCH_NEURONX_DIST_CHECK", "1")
        if mode not in ("0", "1", "gloo"):
            raise ValueError(f"TORCH_NEURONX_DIST_CHECK={mode!r}: expected 0 (no peer agreement "
                             "check), 1 (shared memory when the group's ranks share a host, else "
                             "a gloo round trip) or gloo (always the gloo round trip)")
        size = pg.size()
        self.slots = None
        if mode != "0" and size > 1 and mode == "1" and shm_agreement.available():
            self.slots = shm_agreement.SharedSlots.negotiate(pg._gloo, pg.rank(), size)
        self.transport = ("off" if mode == "0" or size <= 1 else
                          "shm" if self.slots is not None else "gloo")
        self._seq = 0

    def verify(self, op: str, signature: str, extra=None) -> list | None:
        """Agree with every peer on ``signature`` before the real collective (see module doc).

        ``extra`` (int list, same length on every rank) is gathered too and returned per rank.
        """
        if self.transport == "off":
            return None
        self._seq += 1
        call = f"{op}|{signature}"
        h = _FINGERPRINTS.get(call)
        if h is None:
            h = int.from_bytes(hashlib.blake2b(call.encode(), digest_size=7).digest(), "little")
            if len(_FINGERPRINTS) < 4096:   # a training loop repeats a few dozen calls
                _FINGERPRINTS[call] = h
        if self.slots is not None:
            try:
                entries = self.slots.exchange(self._seq, h, extra or (),
                                               self._pg._timeout.total_seconds())
            except shm_agreement.PeerMissing as e:
                raise self.missing_error(op, e) from e
            agreed = all(fp == h for fp, _ in entries)
            gathered = [ex for _, ex in entries]
        else:
            try:
                agreed, gathered = self._verify_gloo(h, extra)
            except RuntimeError as e:
                raise self.comm_error(op, e) from e
        if agreed:
            return None if extra is None else gathered
        # Disagreement: every rank reaches this point, so exchanging the descriptions is safe.
        desc = f"{op}({signature})".encode()[:255]
        buf = torch.zeros(256, dtype=torch.uint8)
        buf[:len(desc)] = torch.frombuffer(bytearray(desc), dtype=torch.uint8)
        outs = [torch.empty_like(buf) for _ in range(self._pg.size())]
        self._pg._gloo.allgather([outs], [buf]).wait()
        calls = [bytes(o.tolist()).rstrip(b"\0").decode(errors="replace") for o in outs]
        lines = "; ".join(f"rank {i}: {c}" for i, c in enumerate(calls))
        raise RuntimeError(
            f"neuron backend: ranks of group {self._pg._group_name!r} called collective #{self._seq} "
            f"with mismatched arguments (every rank must call the same collective with the same "
            f"dtype and number of elements): {lines}")

    def _verify_gloo(self, h: int, extra) -> tuple:
        """The agreement as a gloo round trip: (whether every fingerprint equals ``h``,
        every rank's ``extra`` or None without it)."""
        if extra is None:
            # max(h) == -max(-h) exactly when every rank's h is the same
            t = torch.tensor([h, -h], dtype=torch.int64)
            opts = _c10d.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self._pg._gloo.allreduce([t], opts).wait()
            return int(t[0]) == -int(t[1]), None
        mine = torch.tensor([h] + list(extra), dtype=torch.int64)
        outs = [torch.empty_like(mine) for _ in range(self._pg.size())]
        self._pg._gloo.allgather([outs], [mine]).wait()
        gathered = [o.tolist() for o in outs]
        return all(g[0] == h for g in gathered), [g[1:] for g in gathered]

    def _why(self, timed_out: bool) -> str:
        if timed_out:
            return (f"timed out after {self._pg._timeout.total_seconds():g}s: a peer rank never "
                    "arrived at this collective (it hung, skipped it, or died)")
        return "a peer rank died or closed its connection"

    def comm_error(self, op: str, e: Exception) -> RuntimeError:
        msg = str(e)
        low = msg.lower()
        if "timed out" in low or "timeout" in low:
            why = self._why(True)
        elif "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
            why = self._why(False)
        else:
            why = "the communication failed"
        return RuntimeError(f"neuron backend: {op} on rank {self._pg.rank()} of group "
                            f"{self._pg._group_name!r} (size {self._pg.size()}): {why} [{msg}]")

    def missing_error(self, op: str, e: shm_agreement.PeerMissing) -> RuntimeError:
        ranks = ", ".join(str(q) if self._pg._global_ranks[q] == q else
                          f"{q} (global rank {self._pg._global_ranks[q]})" for q in e.ranks)
        what = ("exited or left the group before reaching" if e.dead else "did not reach")
        return RuntimeError(f"neuron backend: {op} on rank {self._pg.rank()} of group "
                            f"{self._pg._group_name!r} (size {self._pg.size()}): {self._why(not e.dead)} "
                            f"[group rank(s) {ranks} {what} collective #{e.seq}]")

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None
