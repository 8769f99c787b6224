"""The router's choice: the k highest of each row of biased scores (score + bias per expert), in one launch.

`torch.topk` on a [4096, 384] float32 tensor took 81 us of a release layer's 4K prefill on the H100 (run 31f's
profile, one `sbtopk` launch): a per-row radix select built for wide rows. A row of 384 fits one program's
registers, so here a block of rows is loaded once and its k picks are k rounds of (row max, the lowest column
holding it, that column knocked out).

Picks come in descending order of value, as `torch.topk(k, sorted=True)`'s; of equal values the lower column
first (torch leaves the order of ties unspecified); NaN counts as larger than every number, as in torch.

biased float32 [T, E] (E >= k) -> int64 [T, k] column indices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _check(biased: torch.Tensor, k: int) -> None:
    if biased.dim() != 2 or not 0 < k <= biased.shape[1]:
        raise ValueError(f"router top-k: biased scores {tuple(biased.shape)} need [T, E] with E >= k = {k}")


def route_topk_reference(biased: torch.Tensor, k: int, **_launch) -> torch.Tensor:
    """The engine's op (engine/model/moe.py top_experts): torch's top-k indices."""
    from engine.model.moe import top_experts
    _check(biased, k)
    return top_experts(biased, k)


@triton.jit
def _route_topk_kernel(s_ptr, out_ptr, T, E, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                       BE: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    live = rows < T
    s = tl.load(s_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=live[:, None] & (cols < E)[None, :],
                other=float("-inf"))
    s = tl.where(s != s, float("inf"), s)  # NaN first, as torch.topk ranks it
    s = tl.where((cols < E)[None, :], s, float("nan"))  # padding: never equal to a row's max, never picked
    slots = tl.arange(0, KP)
    picked = tl.zeros([BT, KP], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(s == s, s, float("-inf")), axis=1)
        col = tl.min(tl.where(s == best[:, None], cols[None, :], BE), axis=1)  # the lowest column at the max
        picked = tl.where(slots[None, :] == j, col[:, None], picked)
        s = tl.where(cols[None, :] == col[:, None], float("nan"), s)  # knocked out: no longer a candidate
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + slots[None, :], picked.to(tl.int64),
             mask=live[:, None] & (slots < K)[None, :])


def route_topk_triton(biased: torch.Tensor, k: int, block_t: int = 16, num_warps: int = 4) -> torch.Tensor:
    """See the module docstring; one launch of ceil(T / block_t) programs, each holding block_t whole rows."""
    _check(biased, k)
    s = biased.float().contiguous()
    t, e = s.shape
    out = torch.empty(t, k, dtype=torch.int64, device=s.device)
    if t:
        _route_topk_kernel[(triton.cdiv(t, block_t),)](s, out, t, e, K=k, KP=triton.next_power_of_2(k), BT=block_t,
                                                        BE=triton.next_power_of_2(e), num_warps=num_warps)
    return out
