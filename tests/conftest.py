"""Suite-wide settings."""

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
