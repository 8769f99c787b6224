"""Suite-wide settings."""

import sys

import pytest
import torch


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
