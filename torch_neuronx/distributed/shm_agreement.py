"""Peer agreement through shared memory, for a process group whose ranks share one host.

Before each collective every rank publishes (sequence number, fingerprint, extra ints) in its
own slot of a small memory-mapped segment and waits until every peer has published the same
sequence number; then each rank holds everyone's entry and can compare. This replaces a
gloo round trip over loopback TCP (hundreds of microseconds on a busy machine) with a few
loads and stores plus one futex wake.

Segment: rank 0 of the group creates a file in /dev/shm, announces its path and a random
nonce to the others with a gloo broadcast, everyone maps it and checks the nonce, and a gloo
MIN of "attached" decides for the whole group (so ranks on several hosts, or a host without
/dev/shm, agree to keep the gloo round trip). Rank 0 then unlinks the file: the mappings stay
valid, and nothing is left in /dev/shm even if a process is killed.

Ring depth 2 is enough: a rank publishes entry N+1 only after it saw every peer's entry N,
and entry N+2 only after every peer published N+1, which each does only after it finished
reading entry N. So the slot N+2 reuses is no longer needed by anyone.

Waiting: polling with sched_yield (peers mostly arrive within that, and a futex wake-up
costs tens of microseconds), then a futex on the peer's slot word (its published sequence
number), woken by the publisher. Polling lasts 100 us when every rank can have a core, and
1 ms when the group has more ranks than this process may use cores: the yield hands the core
to any runnable thread (the ranks still on their way, their gloo threads), while a rank asleep
on a futex, once woken, queues for a core behind those threads. Measured with 4 ranks on 2
cores (1-4 MiB all_reduce), sleeping at once left all ranks through the agreement a median
0.4 ms after the last arrived, and cost 5-8% of all_reduce bandwidth against polling.
Liveness: each rank holds a POSIX record lock on one byte of the file; the kernel drops it
when the process exits or closes the group, which a waiting peer detects with a non-blocking
lock attempt. Works across pid namespaces, unlike probing pids.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import platform
import secrets
import struct
import time
import warnings

import torch

_MAGIC = b"TNXAGREE"
_HEADER = 64          # magic (8) + nonce (16), padded to a cache line
_DEPTH = 2
_HDR = struct.Struct("<II")        # slot word: sequence number (low 32 bits, the futex word), count
_PAYLOADS = {}                     # count -> Struct of fingerprint, tag, ``count`` extra ints
_M64 = (1 << 64) - 1
_ANNOUNCE = 256                    # bytes of the broadcast that carries path and nonce
# Seconds between liveness probes while a peer is missing: bounds how late a dead peer is seen.
_PROBE_EVERY = 0.1
# Seconds an exchange polls for missing peers before it sleeps on a futex: when every rank
# can have a core, and when there are more ranks than cores (see the module doc).
_SPIN = 100e-6
_SPIN_OVERSUBSCRIBED = 1e-3

# futex(2) has no libc wrapper; on other architectures the group keeps the gloo round trip.
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall():
    if _SYS_FUTEX is None or not os.path.isdir("/dev/shm"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return fn


_syscall = _load_syscall()


def available() -> bool:
    """Whether this platform can run the shared-memory agreement at all."""
    return _syscall is not None


class PeerMissing(Exception):
    """Peers that did not publish the awaited entry: ``dead`` when they exited or closed the
    group, else the wait timed out."""

    def __init__(self, ranks: list, seq: int, dead: bool):
        super().__init__(f"rank(s) {ranks} {'died' if dead else 'missing'} at #{seq}")
        self.ranks = ranks
        self.seq = seq
        self.dead = dead


def _tag(seq: int, fp: int, extra) -> int:
    # Validates an entry as one write: on a weakly ordered CPU a reader may see the new
    # sequence number before the payload stores; a stale payload then fails this check.
    h = (fp ^ (seq * 0x9E3779B97F4A7C15)) & _M64
    for x in extra:
        h = ((h ^ (x & _M64)) * 0x100000001B3) & _M64
    return h


class SharedSlots:
    """One group's segment as seen by one rank (see the module doc)."""

    def __init__(self, fd: int, mm: mmap.mmap, rank: int, size: int):
        self._fd = fd
        self._mm = mm
        self._rank = rank
        self._size = size
        self._entry = _entry_bytes(size)
        self._cap = 2 * size
        # ctypes view only to learn the mapping's address for futex(2); dropped before close
        self._anchor = ctypes.c_char.from_buffer(mm)
        self._base = ctypes.addressof(self._anchor)
        self._peers = [q for q in range(size) if q != rank]
        self._spin = (_SPIN if size <= len(os.sched_getaffinity(0)) else
                      _SPIN_OVERSUBSCRIBED)

    # --- setup ----------------------------------------------------------------------------
    @classmethod
    def negotiate(cls, gloo, rank: int, size: int) -> "SharedSlots | None":
        """Collective over ``gloo``: a segment every rank of the group has mapped, or None
        on every rank when any of them cannot map rank 0's (another host, no /dev/shm)."""
        nbytes = _HEADER + size * _DEPTH * _entry_bytes(size)
        fd = mm = None
        path = ""
        try:
            buf = torch.zeros(_ANNOUNCE, dtype=torch.uint8)
            if rank == 0:
                nonce = secrets.token_bytes(16)
                fd, mm, path = _create(nbytes, nonce)
                if fd is not None:
                    msg = f"{path}\n{nonce.hex()}".encode()
                    buf[:len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
            gloo.broadcast([buf], _broadcast_opts()).wait()
            msg = bytes(buf.tolist()).rstrip(b"\0").decode()
            if rank != 0 and msg:
                their_path, nonce_hex = msg.split("\n")
                fd, mm = _attach(their_path, nbytes, bytes.fromhex(nonce_hex))
            if fd is not None and not _lock(fd, rank):
                _close(fd, mm)
                fd = mm = None
            ok = torch.tensor([0 if fd is None else 1], dtype=torch.int32)
            gloo.allreduce([ok], _min_opts()).wait()
        except BaseException:
            _close(fd, mm)
            raise
        finally:
            # every rank has mapped it or given up once the MIN above completed
            if path:
                os.unlink(path)
        if int(ok[0]) == 1:
            return cls(fd, mm, rank, size)
        _close(fd, mm)
        return None

    def close(self) -> None:
        if self._mm is None:
            return
        self._anchor = None
        self._mm.close()
        os.close(self._fd)   # also drops the liveness lock: peers still waiting see us gone
        self._mm = None

    # --- the exchange ---------------------------------------------------------------------
    def exchange(self, seq: int, fp: int, extra, timeout: float) -> list:
        """Publish (fp, extra) as entry ``seq``; return every rank's (fp, extra) in rank order.

        Raises PeerMissing when a peer exited or did not publish within ``timeout`` seconds.
        """
        if len(extra) > self._cap:
            raise ValueError(f"shared agreement: {len(extra)} extra ints exceed the slot's "
                             f"{self._cap}")
        mm = self._mm
        slot = seq % _DEPTH
        off = self._offset(self._rank, slot)
        n = len(extra)
        _payload(n).pack_into(mm, off + 8, fp, _tag(seq, fp, extra), *extra)
        _HDR.pack_into(mm, off, seq & 0xFFFFFFFF, n)
        _syscall(_SYS_FUTEX, self._base + off, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
        out = [None] * self._size
        out[self._rank] = (fp, list(extra))
        deadline = spin_until = None
        for q in self._peers:
            got = self._read(q, slot, seq)
            if got is None:
                if deadline is None:
                    deadline = time.monotonic() + timeout
                    spin_until = time.perf_counter() + self._spin
                got = self._wait(q, slot, seq, deadline, spin_until)
            out[q] = got
        return out

    def _offset(self, rank: int, slot: int) -> int:
        return _HEADER + (rank * _DEPTH + slot) * self._entry

    def _read(self, q: int, slot: int, seq: int):
        off = self._offset(q, slot)
        s32, n = _HDR.unpack_from(self._mm, off)
        if s32 != seq & 0xFFFFFFFF or n > self._cap:
            return None
        fp, tag, *extra = _payload(n).unpack_from(self._mm, off + 8)
        if tag != _tag(seq, fp, extra):
            return None
        return fp, extra

    def _wait(self, q: int, slot: int, seq: int, deadline: float, spin_until: float):
        # Peers usually arrive within tens of microseconds: polling (yielding the core to
        # whatever else is runnable) until ``spin_until`` saves the futex wake-up, which
        # costs as much again.
        while time.perf_counter() < spin_until:
            got = self._read(q, slot, seq)
            if got is not None:
                return got
            os.sched_yield()
        off = self._offset(q, slot)
        addr = self._base + off
        ts = _Timespec()
        next_probe = time.monotonic() + _PROBE_EVERY
        while True:
            s32 = _HDR.unpack_from(self._mm, off)[0]
            got = self._read(q, slot, seq)
            if got is not None:
                return got
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + _PROBE_EVERY
                self._raise_if_dead(slot, seq)
            if now >= deadline:
                missing = [p for p in self._peers if self._read(p, slot, seq) is None]
                raise PeerMissing(missing, seq, dead=False)
            if s32 == seq & 0xFFFFFFFF:
                # published but the payload is not visible yet (see _tag): it is a matter of
                # nanoseconds, a futex wait on an unchanged word would sleep the full slice
                os.sched_yield()
                continue
            pause = min(deadline, next_probe) - now
            ts.tv_sec = int(pause)
            ts.tv_nsec = int((pause - ts.tv_sec) * 1e9)
            r = _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, s32, ctypes.addressof(ts), None, 0)
            if r == -1:
                err = ctypes.get_errno()
                if err not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
                    raise OSError(err, f"futex wait: {os.strerror(err)}")

    def _raise_if_dead(self, slot: int, seq: int) -> None:
        dead = []
        for p in self._peers:
            if self._read(p, slot, seq) is not None:
                continue     # published: whether it lives on does not matter to this entry
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, p)
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    continue     # held: the peer is alive
                raise
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, p)
            # it may have published just before it closed the group
            if self._read(p, slot, seq) is None:
                dead.append(p)
        if dead:
            raise PeerMissing(dead, seq, dead=True)


def _payload(n: int) -> struct.Struct:
    s = _PAYLOADS.get(n)
    if s is None:
        s = _PAYLOADS[n] = struct.Struct(f"<QQ{n}q")
    return s


def _entry_bytes(size: int) -> int:
    # slot word + fingerprint + tag + room for all_to_all_single's split matrix row (2 per
    # rank), on whole cache lines so that ranks' slots do not share one
    return (24 + 16 * size + 63) // 64 * 64


def _create(nbytes: int, nonce: bytes):
    """Rank 0's segment: (fd, mmap, path), or (None, None, "") when this host cannot make one."""
    if not available():
        return None, None, ""
    path = f"/dev/shm/torch_neuronx_agree_{os.getpid()}_{secrets.token_hex(8)}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        warnings.warn(f"neuron backend: cannot create {path} ({e}); this group's ranks agree "
                      "before each collective over gloo instead (slower)", stacklevel=2)
        return None, None, ""
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    mm[:len(_MAGIC) + len(nonce)] = _MAGIC + nonce
    return fd, mm, path


def _attach(path: str, nbytes: int, nonce: bytes):
    """Map rank 0's segment: (fd, mmap), or (None, None) when it is not reachable from here
    (another host or container) or is not the one announced."""
    if not available():
        return None, None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None     # rank 0 is on another host
    except PermissionError:
        return None, None     # another user's file: not ours to share
    if os.fstat(fd).st_size != nbytes:   # not the announced segment; mapping it could fault
        os.close(fd)
        return None, None
    mm = mmap.mmap(fd, nbytes)
    if mm[:len(_MAGIC) + len(nonce)] != _MAGIC + nonce:
        mm.close()
        os.close(fd)
        return None, None     # a same-named file of another host's namespace
    return fd, mm


def _lock(fd: int, rank: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN, errno.ENOLCK):
            return False   # no record locks on this filesystem: no liveness probe, use gloo
        raise
    return True


def _close(fd, mm) -> None:
    if mm is not None:
        mm.close()
    if fd is not None:
        os.close(fd)


def _broadcast_opts():
    from torch._C import _distributed_c10d as c10d
    opts = c10d.BroadcastOptions()
    opts.rootRank = 0
    return opts


def _min_opts():
    from torch._C import _distributed_c10d as c10d
    opts = c10d.AllreduceOptions()
    opts.reduceOp = c10d.ReduceOp.MIN
    return opts
