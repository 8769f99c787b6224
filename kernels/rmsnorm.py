"""RMSNorm over the last axis: y = x * rsqrt(mean(x^2) + eps) * weight, optionally stored bf16-rounded.

Shapes: x float32 or bf16 [..., D]; weight float32 [D] or None -> float32 [..., D]. round_bf16: each
output rounded to bf16 (to nearest even) but kept as float32, as the reference numerics store an
activation (engine/ops/reference.py `act`); the engine then needs no rounding copy of its own.
out_dtype=torch.bfloat16: those rounded values stored as bf16 (half the bytes written; with bf16 rows in,
the 4-byte-per-value row PERFORMANCE.md's goal assumes).

One program per block of rows, the whole row in registers (D up to 16K): one read of x, one write.
Or (`programs_per_sm`) a few programs per SM, each walking rows with the next row's load issued before
this row's reduction, and the weight loaded once per program instead of once per row.
The sum of squares is a tree reduction, not torch's order, so results differ from the reference in the
last fp32 bits (and rarely by one bf16 step after rounding); the test bounds both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._formats import cast_rne, sm_count

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
    y = _normalized(x, eps, D)
    if HAS_W:  # loaded after the reduction, not live across it (sm_90: 44 registers, 58 loaded before it)
        y = y * tl.load(w_ptr + d, mask=d < D, other=0.0)[None, :]
    tl.store(y_ptr + offs, _rounded(y, y_ptr, ROUND), mask=m)


@triton.jit
def _normalized(x, eps, D: tl.constexpr):
    """Rows x [R, BD] (float32, zero past D) over their root mean square."""
    ms = tl.sum(x * x, axis=1) / D + eps
    inv = tl.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms))  # 1 / sqrt, each step rounded once
    return x * inv[:, None]


@triton.jit
def _rounded(y, y_ptr, ROUND: tl.constexpr):
    """y as stored: rounded to bf16 values (to nearest even) when asked or when y_ptr is bf16."""
    if ROUND:
        y = cast_rne(y, tl.bfloat16)
        if y_ptr.dtype.element_ty != tl.bfloat16:
            y = y.to(tl.float32)
    return y


@triton.jit
def _rms_norm_rows_kernel(x_ptr, w_ptr, y_ptr, rows, eps, D: tl.constexpr, BD: tl.constexpr,
                          HAS_W: tl.constexpr, ROUND: tl.constexpr):
    """Rows pid, pid + G, ... (G programs): row r + G is loaded before row r is reduced and stored."""
    step = tl.num_programs(0)
    dw = tl.arange(0, BD)
    if HAS_W:
        w = tl.load(w_ptr + dw, mask=dw < D, other=0.0)[None, :]
    d = dw[None, :]  # one row as a [1, BD] tile
    dm = d < D
    # row pointers carried and advanced by G rows: 64-bit addresses without 64-bit row indices
    xr = x_ptr + tl.program_id(0) * D
    yr = y_ptr + tl.program_id(0) * D
    x = tl.load(xr + d, mask=dm & (tl.program_id(0) < rows), other=0.0).to(tl.float32)
    for r in range(tl.program_id(0), rows, step):
        xr += step * D
        x_next = tl.load(xr + d, mask=dm & (r + step < rows), other=0.0).to(tl.float32)
        y = _normalized(x, eps, D)
        if HAS_W:
            y = y * w
        tl.store(yr + d, _rounded(y, y_ptr, ROUND), mask=dm)
        yr += step * D
        x = x_next


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    round_bf16: bool = False, rows_per_program: int | None = None,
                    out_dtype: torch.dtype = torch.float32, programs_per_sm: int = 0,
                    num_warps: int | None = None) -> torch.Tensor:
    """The kernel; rows_per_program: rows a program normalizes (default: 1 for rows of 4K+ values, more
    for short rows, so that a program loads at least ~4K values); programs_per_sm > 0: the row-walking
    kernel with that many programs an SM instead; out_dtype float32, or bfloat16 (the values rounded to
    nearest even: round_bf16 implied)."""
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
    if programs_per_sm:
        grid = min(rows, programs_per_sm * sm_count(x.device))
        _rms_norm_rows_kernel[(grid,)](x2, w, out, rows, float(eps), D=d, BD=bd, HAS_W=weight is not None,
                                       ROUND=rnd, num_warps=num_warps or (8 if bd >= 4096 else 4))
        return out.view(*x.shape[:-1], d)
    _rms_norm_kernel[(triton.cdiv(rows, br),)](x2, w, out, rows, float(eps), D=d, BD=bd, BR=br,
                                              HAS_W=weight is not None, ROUND=rnd,
                                              num_warps=num_warps or (8 if bd * br >= 4096 else 4))
    return out.view(*x.shape[:-1], d)
