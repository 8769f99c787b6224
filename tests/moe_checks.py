"""What the routed experts' kernel tests share: the comparison against the engine's hidden-state numerics."""

from __future__ import annotations

import torch


def close_but_one_token(want: torch.Tensor, got: torch.Tensor, bound: float) -> bool:
    """The engine's hidden state (w * h rounded to bf16, then E4M3 per 32) is float32 arithmetic in the kernels and
    float64 in their references: a value that lands on opposite sides of a rounding boundary (about one draw in 300
    at 40 tokens) moves its token's whole output row by that step. True if every other row is within `bound` of
    the reference (relative) and the whole within 1e-3 (the other numerics are ~1e-2 away)."""
    want, got = want.double(), got.double()
    off = (got - want).norm(dim=-1) > bound * want.norm(dim=-1)
    if off.sum() > 1:
        return False
    rest = (got[~off] - want[~off]).norm() <= bound * want[~off].norm()
    return bool(rest) and bool((got - want).norm() < 1e-3 * want.norm())
