"""Memory layouts the kernels' tests write out by hand, apart from the kernels' own index maps (torch only: safe
to import in a GPU test's fresh process)."""

from __future__ import annotations

import torch


def mma_k_index(k: int) -> torch.Tensor:
    """Where memory column c of a K-wide row lands in the MMA K order of each 64 block (in_mma_k_order): idx[c]."""
    m = torch.arange(64)
    pos = ((m >> 2) & 3) * 16 + ((m >> 1) & 1) * 8 + (m >> 4) * 2 + (m & 1)
    assert sorted(pos.tolist()) == list(range(64))
    return (torch.arange(k // 64)[:, None] * 64 + pos[None, :]).flatten()
