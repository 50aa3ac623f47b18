"""How a kernel refuses an option this library does not implement: one message shape for
every kernel, so callers can match on it and users see which kernel and which option."""
from __future__ import annotations

from nki import errors as E


def unsupported(kernel, what):
    raise E.UnsupportedError(f"{kernel}: {what} is not implemented in this NKI-lib")


def refuse_given(kernel, options):
    """Refuse the first ``(what, value)`` of ``options`` whose value was passed (not None)."""
    for what, val in options:
        if val is not None:
            unsupported(kernel, what)
