"""The training step's attention over picked entries, without gathering them: three Triton kernels and
two differentiable ops built from them.

The trainer's global branch attends, for each token t, the k entries its index source picked. Done
with PyTorch ops it first gathers them into a [B, T, k, D] tensor (16 KB per token in bf16, written,
read by the forward, the recompute and the backward, its gradient summed over the 4-6 layers that
share it and scattered back: in the profile ~0.2-0.3 s of a 1.06 s step). Here each program handles one
token and reads the picked rows of the sequence's entries [N, D] directly (the entries of one sequence
are a few hundred KB: they stay in L2):

  gather_scores(a, E, idx)[t, h, j]  = a[t, h] . E[idx[t, j]]                 (scores; also d/dp)
  gather_combine(w, E, idx)[t, h]    = sum_j w[t, h, j] E[idx[t, j]]          (output; also d/dq)
  scatter_picks(a, w, idx)[n]        = sum_{t, j: idx[t, j] = n} sum_h w[t, h, j] a[t, h]   (d/dE)

The scatter adds into a float32 [B, N, D] buffer with atomic adds: its summation order is not fixed,
so the entries' gradient is not bitwise reproducible run to run (float32 rounding only).
Picks marked -1 are skipped (their scores come back 0; the caller masks them).
Shapes: a [B, T, H, D], E [B, N, D], idx [B, T, K] (int), w [B, T, H, K]; D a multiple of 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dims(heads: tuple, entries: torch.Tensor, idx: torch.Tensor, w: torch.Tensor | None = None):
    """(B, T, H, D, N, K) from a per-head operand's shape `heads` [B, T, H, D], entries [B, N, D],
    idx [B, T, K] and, where given, the weights w [B, T, H, K]; ValueError where they disagree."""
    if len(heads) != 4 or entries.dim() != 3 or idx.dim() != 3:
        raise ValueError("picked-entry attention wants a [B, T, H, D], entries [B, N, D], idx [B, T, K]")
    B, T, H, D = heads
    if entries.shape[0] != B or entries.shape[2] != D or idx.shape[:2] != (B, T) or D % 16:
        raise ValueError(f"shapes disagree: a {tuple(heads)}, entries {tuple(entries.shape)}, idx {tuple(idx.shape)}"
                         " (D a multiple of 16)")
    K = idx.shape[2]
    if w is not None and tuple(w.shape) != (B, T, H, K):
        raise ValueError(f"weights {tuple(w.shape)} and idx {tuple(idx.shape)} disagree (want [B, T, H, K])")
    return B, T, H, D, entries.shape[1], K


@triton.jit
def _picks(idx_ptr, pid, T, N, K, D: tl.constexpr, KP: tl.constexpr):
    """Token pid's picks: (element offsets of their rows in E [B*N, D] as int64, mask of real picks)."""
    j = tl.arange(0, KP)
    pick = tl.load(idx_ptr + pid.to(tl.int64) * K + j, mask=j < K, other=-1).to(tl.int64)
    ok = (pick >= 0) & (j < K)
    return ((pid // T).to(tl.int64) * N + tl.where(ok, pick, 0)) * D, ok


@triton.jit
def _head_chunk(a_ptr, pid, h, d, H: tl.constexpr, D: tl.constexpr):
    """a[token pid, heads h, dims d] as float32 [HP, BD] (padded heads 0)."""
    return tl.load(a_ptr + (pid.to(tl.int64) * H + h[:, None]) * D + d[None, :], mask=(h < H)[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def _entry_chunk(e_ptr, rows, ok, d):
    """The picked entries' dims d as float32 [KP, BD] (missing picks 0)."""
    return tl.load(e_ptr + rows[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _pick_weights(w_ptr, pid, h, j, ok, H: tl.constexpr, K):
    """w[token pid] as float32 [HP, KP] (missing picks and padded heads 0)."""
    return tl.load(w_ptr + (pid.to(tl.int64) * H + h[:, None]) * K + j[None, :],
                   mask=(h < H)[:, None] & ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _weighted_token(w_ptr, idx_ptr, T, N, K, H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, KP: tl.constexpr):
    """This program's token, its head lanes, picks (rows, mask) and weights [HP, KP]."""
    pid = tl.program_id(0)
    h = tl.arange(0, HP)
    rows, ok = _picks(idx_ptr, pid, T, N, K, D, KP)
    return pid, h, rows, ok, _pick_weights(w_ptr, pid, h, tl.arange(0, KP), ok, H, K)


@triton.jit
def _scores_kernel(a_ptr, e_ptr, idx_ptr, out_ptr, T, N, K, H: tl.constexpr, D: tl.constexpr,
                   HP: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)                       # one token of B * T
    h, j = tl.arange(0, HP), tl.arange(0, KP)
    rows, ok = _picks(idx_ptr, pid, T, N, K, D, KP)
    acc = tl.zeros((HP, KP), dtype=tl.float32)
    for d0 in tl.static_range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        acc += tl.sum(_head_chunk(a_ptr, pid, h, d, H, D)[:, None, :] * _entry_chunk(e_ptr, rows, ok, d)[None, :, :],
                      axis=2)
    tl.store(out_ptr + (pid.to(tl.int64) * H + h[:, None]) * K + j[None, :], acc,
             mask=(h < H)[:, None] & (j < K)[None, :])


@triton.jit
def _combine_kernel(w_ptr, e_ptr, idx_ptr, out_ptr, T, N, K, H: tl.constexpr, D: tl.constexpr,
                    HP: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr):
    pid, h, rows, ok, w = _weighted_token(w_ptr, idx_ptr, T, N, K, H, D, HP, KP)
    for d0 in tl.static_range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        o = tl.sum(w[:, :, None] * _entry_chunk(e_ptr, rows, ok, d)[None, :, :], axis=1)  # [HP, BD]
        tl.store(out_ptr + (pid.to(tl.int64) * H + h[:, None]) * D + d[None, :], o, mask=(h < H)[:, None])


@triton.jit
def _scatter_kernel(a_ptr, w_ptr, idx_ptr, g_ptr, T, N, K, H: tl.constexpr, D: tl.constexpr,
                    HP: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr):
    pid, h, rows, ok, w = _weighted_token(w_ptr, idx_ptr, T, N, K, H, D, HP, KP)
    for d0 in tl.static_range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        v = tl.sum(w[:, :, None] * _head_chunk(a_ptr, pid, h, d, H, D)[:, None, :], axis=0)  # [KP, BD]
        tl.atomic_add(g_ptr + rows[:, None] + d[None, :], v, mask=ok[:, None])


def _run(kernel, x, y, idx, out, n_entries: int, D: int):
    """One launch, one program per token of x [B, T, H, ...]."""
    B, T, H = x.shape[:3]
    K = idx.shape[2]
    if B * T:
        kernel[(B * T,)](x.contiguous(), y.contiguous(), idx.contiguous(), out, T, n_entries, K,
                         H=H, D=D, HP=_pow2(H), KP=_pow2(K), BD=32 if D % 32 == 0 else 16)
    return out


def gather_scores(a: torch.Tensor, entries: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[B, T, H, K] float32: a[b, t, h] . entries[b, idx[b, t, j]] (0 where idx is -1)."""
    B, T, H, D, N, K = _dims(a.shape, entries, idx)
    out = torch.empty(B, T, H, K, device=a.device, dtype=torch.float32)
    return _run(_scores_kernel, a, entries, idx, out, N, D)


def gather_combine(w: torch.Tensor, entries: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] float32: sum_j w[b, t, h, j] entries[b, idx[b, t, j]] (picks at -1 skipped)."""
    B, T, H, D, N, K = _dims((*w.shape[:3], entries.shape[-1]), entries, idx, w)
    out = torch.empty(B, T, H, D, device=w.device, dtype=torch.float32)
    return _run(_combine_kernel, w, entries, idx, out, N, D)


def scatter_picks(a: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, n_entries: int) -> torch.Tensor:
    """[B, N, D] float32: sum over the picks of entry n of sum_h w[b, t, h, j] a[b, t, h]."""
    out = torch.zeros(a.shape[0], n_entries, a.shape[-1], device=a.device, dtype=torch.float32)
    B, T, H, D, N, K = _dims(a.shape, out, idx, w)
    return _run(_scatter_kernel, a, w, idx, out, N, D)


# -- differentiable ops (opaque to torch.compile) ----------------------------------------------------

@torch.library.custom_op("v41::picked_scores", mutates_args=())
def picked_scores(q: torch.Tensor, entries: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D] against each token's picked entries: [B, T, H, K] float32; idx -1 = no pick."""
    return gather_scores(q, entries, idx)


@picked_scores.register_fake
def _(q, entries, idx):
    return q.new_empty(*q.shape[:3], idx.shape[2], dtype=torch.float32)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scores_backward(ctx, grad):
    q, entries, idx = ctx.saved_tensors
    grad = grad.float()
    dq = picked_combine(grad, entries, idx).to(q.dtype)
    de = _picked_scatter(q, grad, idx, entries.shape[1]).to(entries.dtype)
    return dq, de, None


picked_scores.register_autograd(_scores_backward, setup_context=_save_inputs)


@torch.library.custom_op("v41::picked_combine", mutates_args=())
def picked_combine(w: torch.Tensor, entries: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """sum_j w[..., j] entries[idx[..., j]]: [B, T, H, D] float32."""
    return gather_combine(w, entries, idx)


@picked_combine.register_fake
def _(w, entries, idx):
    return w.new_empty(*w.shape[:3], entries.shape[2], dtype=torch.float32)


def _combine_backward(ctx, grad):
    w, entries, idx = ctx.saved_tensors
    grad = grad.float()
    dw = picked_scores(grad, entries, idx).to(w.dtype)
    de = _picked_scatter(grad, w.float(), idx, entries.shape[1]).to(entries.dtype)
    return dw, de, None


picked_combine.register_autograd(_combine_backward, setup_context=_save_inputs)


@torch.library.custom_op("v41::picked_scatter", mutates_args=())
def _picked_scatter(a: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, n_entries: int) -> torch.Tensor:
    return scatter_picks(a, w, idx, n_entries)


@_picked_scatter.register_fake
def _(a, w, idx, n_entries):
    return a.new_empty(a.shape[0], n_entries, a.shape[3], dtype=torch.float32)
