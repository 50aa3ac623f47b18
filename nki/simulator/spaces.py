"""The memories a tensor lives in, as ``nki.language`` names them (``nl.sbuf``, ``nl.psum``,
``nl.hbm``, ``nl.shared_hbm``, ``nl.private_hbm``)."""
from __future__ import annotations


class Buffer:
    def __init__(self, name, kind):
        self.name, self.kind = name, kind

    def __repr__(self):
        return f"nki.language.{self.name}"


BUFFERS = {k: Buffer(k, k) for k in ("sbuf", "psum", "hbm", "shared_hbm", "private_hbm")}
