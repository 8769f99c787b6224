"""RMSNorm over the last axis: y = x * rsqrt(mean(x^2) + eps) * weight, optionally stored bf16-rounded.

Shapes: x float32 or bf16 [..., D]; weight float32 [D] or None -> float32 [..., D]. round_bf16: each
output rounded to bf16 (to nearest even) but kept as float32, as the reference numerics store an
activation (engine/ops/reference.py `act`); the engine then needs no rounding copy of its own.
out_dtype=torch.bfloat16: those rounded values stored as bf16 (half the bytes written; with bf16 rows in,
the 4-byte-per-value row PERFORMANCE.md's goal assumes).

One program per block of rows, the whole row in registers (D up to 16K): one read of x, one write.
The sum of squares is a tree reduction, not torch's order, so results differ from the reference in the
last fp32 bits (and rarely by one bf16 step after rounding); the test bounds both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import cast_rne

MAX_WIDTH = 16384  # the longest row one program holds in registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       round_bf16: bool = False) -> torch.Tensor:
    """engine/ops/fp32.py's rms_norm (float32), rounded to bf16 values if asked."""
    from engine.ops.fp32 import rms_norm
    y = rms_norm(x, weight, eps)
    return y.bfloat16().float() if round_bf16 else y


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                     HAS_W: tl.constexpr, ROUND: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    m = (r < rows)[:, None] & (d < D)[None, :]
    offs = r.to(tl.int64)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=1) / D + eps
    inv = tl.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms))  # 1 / sqrt, each step rounded once
    y = x * inv[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + d, mask=d < D, other=0.0)[None, :]
    if ROUND:
        y = cast_rne(y, tl.bfloat16)
        if y_ptr.dtype.element_ty != tl.bfloat16:
            y = y.to(tl.float32)
    tl.store(y_ptr + offs, y, mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    round_bf16: bool = False, rows_per_program: int | None = None,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kernel; rows_per_program: rows a program normalizes (default: 1 for rows of 4K+ values, more
    for short rows, so that a program loads at least ~4K values); out_dtype float32, or bfloat16 (the
    values rounded to nearest even: round_bf16 implied)."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    d = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"weight must be [{d}], got {tuple(weight.shape)}")
    if d > MAX_WIDTH:
        raise ValueError(f"rows of {d} values do not fit one program (at most {MAX_WIDTH})")
    x2 = x.reshape(-1, d).contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, d, dtype=out_dtype, device=x.device)
    if rows == 0:
        return out.view(*x.shape[:-1], d)
    bd = triton.next_power_of_2(d)
    br = rows_per_program or max(1, min(16, 4096 // bd))
    w = weight.float().contiguous() if weight is not None else out
    rnd = bool(round_bf16) or out_dtype == torch.bfloat16
    _rms_norm_kernel[(triton.cdiv(rows, br),)](x2, w, out, rows, float(eps), D=d, BD=bd, BR=br,
                                              HAS_W=weight is not None, ROUND=rnd,
                                              num_warps=8 if bd * br >= 4096 else 4)
    return out.view(*x.shape[:-1], d)
