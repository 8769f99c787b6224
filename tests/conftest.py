"""Suite-wide settings."""

import random
import sys

import pytest
import torch


_empty, _empty_like = torch.empty, torch.empty_like


def _poison(t):
    if t.is_floating_point() and t.dtype.itemsize >= 2:
        return t.fill_(float("nan"))
    return t.view(torch.uint8).fill_(0xA5).view(t.dtype) if t.numel() else t


@pytest.fixture
def gen():
    """A generator with a fresh random seed (the kernel tests: each run draws new inputs)."""
    return torch.Generator().manual_seed(random.randrange(2**31))


@pytest.fixture
def poisoned(monkeypatch):
    """The kernel tests: new buffers (torch.empty / empty_like) hold NaN or 0xA5 bytes, so an element a
    kernel leaves unwritten shows in its output."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_empty_like(*a, **k)))


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The engine computes on one torch thread (engine.run.api.one_thread); tests that drive the model
    directly do the same, so the suite stays fast on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_runtest_setup(item):
    """Once a test module has brought in Triton's interpreter (the kernel tests, TRITON_INTERPRET=1), give
    it the cached builtin scan of tests/triton_interp.py: the same kernels computed, in less time.
    Triton is never imported here for a suite that does not use it."""
    if "triton.runtime.interpreter" in sys.modules:
        from triton_interp import speed_up
        speed_up()
