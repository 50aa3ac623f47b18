"""Software pipelining of a kernel's units of work, for engines that run in program order."""
from __future__ import annotations

_DONE = object()


def pipeline(units):
    """Issues the stages of generator ``units`` interleaved: a new unit starts every tick,
    and each unit's stages follow each other as many ticks apart as the stage yields. Each
    engine runs its instructions in program order, so while a unit waits for another engine
    (the semaphore latency), the engines work on the stages of the units before and after
    it. A unit must not read what a later unit writes in an earlier stage: the simulator
    computes values in issue order."""
    live = []                 # [generator, ticks until its next stage]
    pending = list(units)
    while pending or live:
        if pending:
            live.append([pending.pop(0), 0])
        for e in list(live):
            if e[1] > 0:
                e[1] -= 1
                continue
            wait = next(e[0], _DONE)
            if wait is _DONE:
                live.remove(e)
            else:
                e[1] = wait - 1
