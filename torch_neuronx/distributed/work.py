"""The ``dist.Work`` of the neuron process group: one collective's gloo works plus the host
steps that finish it; its future resolves to the caller's (device) tensors, as CUDA's does."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .staging import HostTensors

_INFINITE = timedelta(milliseconds=-1)
_ZERO = timedelta(0)


class NeuronWork(dist.Work):
    """Work of one collective: waits on gloo's works, then finishes the host-side steps; its
    future resolves to the caller's (device) tensors, as CUDA's does."""

    def __init__(self, pg, op: str, works: list, result: list, host: HostTensors):
        super().__init__()
        self._pg = pg
        self._op = op
        self._works = works
        self._result = result
        self._host = host
        self._fut = None

    def _finish(self) -> None:
        # wait() and the future's callback (a gloo thread) may both get here: popping the
        # attribute is atomic under the GIL, so exactly one of them finishes the host side.
        host = self.__dict__.pop("_host", None)
        if host is not None:
            host.finish()

    def wait(self, timeout=None) -> bool:
        try:
            if timeout is None or timeout == _ZERO or timeout == _INFINITE:
                for w in self._works:
                    w.wait()
            else:
                for w in self._works:
                    w.wait(timeout)
        except RuntimeError as e:
            raise self._pg._agreement.comm_error(self._op, e) from e
        self._finish()
        return True

    def get_future(self):
        if self._fut is None:
            futs = [w.get_future() for w in self._works]
            if not futs:
                base = torch.futures.Future()
                base.set_result([])
            elif len(futs) == 1:
                base = futs[0]
            else:
                base = torch.futures.collect_all(futs)

            def done(f, futs=futs):
                for g in futs:
                    g.value()  # re-raise a communication error
                self._finish()
                return self._result

            self._fut = base.then(done)
        return self._fut

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self):
        for w in self._works:
            e = w.exception()
            if e is not None:
                return e
        return None

    def result(self) -> list:
        return self._result

    def synchronize(self) -> None:
        # The device runs in issue order on the host: nothing to order beyond wait().
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        return self._works[0]._source_rank()

    def _source_rank(self) -> int:
        return self._works[0]._source_rank()


class CombinedWork(NeuronWork):
    """Several works completed as one (coalesced and list collectives)."""

    def __init__(self, pg, op, works, result):
        super().__init__(pg, op, [], result, None)
        self._parts = works

    def wait(self, timeout=None) -> bool:
        for w in self._parts:
            w.wait(timeout)
        return True

    def get_future(self):
        if self._fut is None:
            futs = [w.get_future() for w in self._parts]
            if not futs:
                base = torch.futures.Future()
                base.set_result(self._result)
                self._fut = base
            else:
                self._fut = torch.futures.collect_all(futs).then(
                    lambda f: ([g.value() for g in f.value()], self._result)[1])
        return self._fut

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._parts)

    def result(self) -> list:
        return self._result
