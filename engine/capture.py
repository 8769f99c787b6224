"""CUDA-graph capture support: which code paths must not branch on device values.

A CUDA graph records kernels, not Python: a host read of a device value (`.item()`, `bool(t)`,
`nonzero`) is refused while a stream captures, and a branch taken at capture time would be frozen into
every replay. The few places of the forward that branch on data (a top-k row with ties, a Reindex row
short of pool entries, the FP8 round trip's non-finite guard) ask `capturing()` and then take a
branch-free form that gives the same values for every row (more work, no host read)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_forced = threading.local()


def capturing() -> bool:
    """True while this thread's current CUDA stream is capturing a graph, or inside `branch_free()`."""
    if getattr(_forced, "on", False):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextmanager
def branch_free():
    """Take the capture-safe forms without capturing (tests compare them with the branching forms)."""
    before = getattr(_forced, "on", False)
    _forced.on = True
    try:
        yield
    finally:
        _forced.on = before
