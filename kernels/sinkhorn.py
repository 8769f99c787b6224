"""Sinkhorn normalization of the mHC mixes for training: forward and backward, one kernel each.

comb = softmax_rows(z) + eps, then columns / (sum + eps), then `iters - 1` rounds of rows then
columns (engine.model.mhc.sinkhorn: the reference the tests hold these kernels to). z, comb: [T, 4, 4]
float32.

Compiled by torch as separate ops, the 20 rounds are ~40 small kernels forward and ~80 backward per
call (in the trainer's profile, 12 k of a step's 35 k launches). Here a program holds a block of
tokens' 4 x 4 matrices in registers for all the rounds. The backward recomputes the forward inside
the kernel, keeping the input of every normalization (2 * iters - 1 of them) in a per-program
scratch region it reads back in reverse (L2-resident, written and read by the same threads), then
applies each normalization's derivative: for out = a / (sum(a) + eps), the gradient on a is
(g - sum(g * out)) / (sum(a) + eps) along the normalized axis.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 64  # tokens per program


@triton.jit
def _rows(c, eps):
    return c / (tl.sum(c, axis=2)[:, :, None] + eps)


@triton.jit
def _cols(c, eps):
    return c / (tl.sum(c, axis=1)[:, None, :] + eps)


@triton.jit
def _rows_back(a, g, eps):
    """Gradient on the input a of `_rows` from the gradient g on its output."""
    d = tl.sum(a, axis=2)[:, :, None] + eps
    return (g - tl.sum(g * (a / d), axis=2)[:, :, None]) / d


@triton.jit
def _cols_back(a, g, eps):
    d = tl.sum(a, axis=1)[:, None, :] + eps
    return (g - tl.sum(g * (a / d), axis=1)[:, None, :]) / d


@triton.jit
def _softmax(z):
    e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    return e / tl.sum(e, axis=2)[:, :, None]


@triton.jit
def _offsets(T, BT: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cell = tl.arange(0, 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    return t[:, None, None] * 16 + cell[None, :, :], (t < T)[:, None, None]


@triton.jit
def _sinkhorn_fwd_kernel(z_ptr, out_ptr, T, eps, ITERS: tl.constexpr, BT: tl.constexpr):
    offs, mask = _offsets(T, BT)
    c = _cols(_softmax(tl.load(z_ptr + offs, mask=mask, other=0.0)) + eps, eps)
    for _ in range(ITERS - 1):
        c = _cols(_rows(c, eps), eps)
    tl.store(out_ptr + offs, c, mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(z_ptr, g_ptr, gz_ptr, scratch_ptr, T, eps, ITERS: tl.constexpr, BT: tl.constexpr):
    offs, mask = _offsets(T, BT)
    # this program's scratch: [2 * ITERS - 1, BT, 16], the input of each normalization in order
    local = (offs - tl.program_id(0) * BT * 16).to(tl.int64)
    state = scratch_ptr + tl.program_id(0).to(tl.int64) * ((2 * ITERS - 1) * BT * 16) + local
    sm = _softmax(tl.load(z_ptr + offs, mask=mask, other=0.0))
    c = sm + eps
    tl.store(state, c)
    c = _cols(c, eps)
    for it in range(1, ITERS):
        tl.store(state + (2 * it - 1) * BT * 16, c)
        c = _rows(c, eps)
        tl.store(state + (2 * it) * BT * 16, c)
        c = _cols(c, eps)
    tl.debug_barrier()
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    for r in range(ITERS - 1):
        it = ITERS - 1 - r
        g = _cols_back(tl.load(state + (2 * it) * BT * 16), g, eps)
        g = _rows_back(tl.load(state + (2 * it - 1) * BT * 16), g, eps)
    g = _cols_back(tl.load(state), g, eps)
    # softmax: dz = sm * (g - sum_j g sm)  (the + eps has no gradient)
    tl.store(gz_ptr + offs, sm * (g - tl.sum(g * sm, axis=2)[:, :, None]), mask=mask)


def _check(z: torch.Tensor) -> torch.Tensor:
    if z.dim() != 3 or z.shape[1:] != (4, 4) or z.dtype != torch.float32:
        raise ValueError(f"Sinkhorn logits must be float32 [T, 4, 4], got {z.dtype} {tuple(z.shape)}")
    return z.contiguous()


def sinkhorn_forward(z: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    z = _check(z)
    out = torch.empty_like(z)
    if z.shape[0]:
        _sinkhorn_fwd_kernel[(triton.cdiv(z.shape[0], BLOCK_T),)](z, out, z.shape[0], eps, ITERS=iters, BT=BLOCK_T)
    return out


def sinkhorn_backward(z: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    z, grad = _check(z), _check(grad)
    gz = torch.empty_like(z)
    if z.shape[0]:
        programs = triton.cdiv(z.shape[0], BLOCK_T)
        scratch = torch.empty(programs * (2 * iters - 1) * BLOCK_T * 16, device=z.device, dtype=torch.float32)
        _sinkhorn_bwd_kernel[(programs,)](z, grad, gz, scratch, z.shape[0], eps, ITERS=iters, BT=BLOCK_T)
    return gz


# -- as a torch op with its gradient, so that torch.compile treats it as one opaque call ----------------

@torch.library.custom_op("v41::sinkhorn", mutates_args=())
def sinkhorn(z: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The Sinkhorn mix of logits z [T, 4, 4] (float32), differentiable; Triton forward and backward."""
    return sinkhorn_forward(z, iters, eps)


@sinkhorn.register_fake
def _(z, iters, eps):
    return torch.empty_like(z)


@torch.library.custom_op("v41::sinkhorn_backward", mutates_args=())
def _sinkhorn_backward_op(z: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return sinkhorn_backward(z, grad, iters, eps)


@_sinkhorn_backward_op.register_fake
def _(z, grad, iters, eps):
    return torch.empty_like(z)


def _setup(ctx, inputs, output):
    z, iters, eps = inputs
    ctx.save_for_backward(z)
    ctx.iters, ctx.eps = iters, eps


def _backward(ctx, grad):
    (z,) = ctx.saved_tensors
    return _sinkhorn_backward_op(z, grad, ctx.iters, ctx.eps), None, None


sinkhorn.register_autograd(_backward, setup_context=_setup)
