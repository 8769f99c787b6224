"""What a top-k leaves to chance (engine/model/attention.py `tie_marks`), one program per row.

Shapes: scores float32 [B, N] (the ranking the picks came from), idx int64 [B, k] (-1 padded), picked float32
[B, k] -> (kth float32 [B]: the k-th pick's score, -inf when a row has fewer than k picks; tied bool [B, k]:
picks at that score while more entries of the row share it than were picked). The torch form takes ~13
launches (a decode step of a Full layer marks ties twice under graph capture); this is one, reading the
row's scores once to count the entries at the k-th score. Comparisons only: the same values bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def tie_marks_reference(scores: torch.Tensor, idx: torch.Tensor, picked: torch.Tensor):
    from engine.model.attention import tie_marks
    return tie_marks(scores, idx, picked)


@triton.jit
def _tie_marks_kernel(s_ptr, idx_ptr, p_ptr, kth_ptr, tied_ptr, N, K, BK: tl.constexpr, BN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BK)
    jm = j < K
    idx = tl.load(idx_ptr + row * K + j, mask=jm, other=0)
    picked = tl.load(p_ptr + row * K + j, mask=jm, other=0.0)
    valid = (idx >= 0) & jm
    full = tl.sum(valid.to(tl.int32), axis=0) == K
    kth = tl.min(tl.where(valid, picked, float("inf")), axis=0)
    kth = tl.where(full, kth, float("-inf"))
    at_kth = (picked == kth) & valid
    n_at = tl.sum(at_kth.to(tl.int32), axis=0)
    sharing = 0
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        v = tl.load(s_ptr + row * N + n, mask=n < N, other=0.0)
        sharing += tl.sum(((v == kth) & (n < N)).to(tl.int32), axis=0)
    tl.store(kth_ptr + row, kth)
    tl.store(tied_ptr + row * K + j, (at_kth & (sharing > n_at)).to(tl.int8), mask=jm)


def tie_marks_triton(scores: torch.Tensor, idx: torch.Tensor, picked: torch.Tensor):
    """The kernel; same inputs and outputs as tie_marks_reference."""
    b, k = picked.shape
    if tuple(idx.shape) != (b, k) or scores.dim() != 2 or scores.shape[0] != b:
        raise ValueError(f"tie marks: scores [B, N], idx and picked [B, k]; got {tuple(scores.shape)}, "
                         f"{tuple(idx.shape)}, {tuple(picked.shape)}")
    kth = torch.empty(b, dtype=torch.float32, device=picked.device)
    tied = torch.empty(b, k, dtype=torch.int8, device=picked.device)
    if k == 0 or b == 0:
        return kth.fill_(float("-inf")), tied.bool()
    n = scores.shape[1]
    _tie_marks_kernel[(b,)](scores.float().contiguous(), idx.contiguous(), picked.float().contiguous(), kth, tied, n, k,
                            BK=triton.next_power_of_2(k), BN=min(4096, triton.next_power_of_2(max(n, 1))), num_warps=4)
    return kth, tied.view(torch.bool)
