"""The training step's attention over picked entries, read in place instead of gathered: Triton kernels
and two differentiable ops built from them.

The trainer's global branch attends, for each token t, the k entries its index source picked. Done
with PyTorch ops it first gathers them into a [B, T, k, D] tensor (16 KB per token in bf16: written,
read by the forward, the recompute and the backward, its gradient summed over the layers that share
it, permuted and scattered back: ~0.33 s of a 1.25 s step on the H200). Here a program takes one token
(TOKENS_PER_PROGRAM: one measured fastest), loads its picked rows of the sequence's entries [N, D] (a
few hundred KB per sequence: they stay in L2) and multiplies them on the tensor cores (heads padded to
16 rows):

  picked_attention(q, E, idx, order, starts) -> (o, lse, s)
      s[t, h, j] = q[t, h] . E[idx[t, j]]                    (-inf where idx is -1)
      lse[t, h]  = logsumexp_j s[t, h, j]                     (-inf for a token with no pick)
      o[t, h]    = sum_j exp(s[t, h, j] - lse[t, h]) E[idx[t, j]]
    The caller merges (o, lse) with the window's own softmax through the two log-sum-exps, so window
    and picks share one softmax as in the gathered form. s is returned without a gradient (the
    trainer's attention-mass statistics).
  picked_scores(a, E, idx, order, starts)[t, h, j] = a[t, h] . E[idx[t, j]]   (0 where idx is -1)

Backward: each token's dq (da) from the same picks, and the entries' gradient as one row per pick,
g[t, j] = sum_h ds[t, h, j] q[t, h] (+ p[t, h, j] do[t, h] for the attention), written out and then
summed per entry through a CSR index of the picks (`pick_index`: the picks sorted by entry, built once
per pick set and shared by every layer that attends it). No atomics: the sum runs in a fixed order
(the picks' flat order within each entry), so the gradient is the same bits run to run. (The first
version, one program per token with CUDA-core products and float32 atomic adds, ran at 68 k tokens/s
against the gathered form's 91.6 k: benches/results/train-step-h200.md.)

Shapes: q / a [B, T, H, D], E [B, N, D], idx [B, T, K] int32 (-1 = no pick); D a power of two >= 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._formats import dot_dtype

# measured on the H200 at 28 x 4,096 (benches/results/picked-attn-h200.md): one token and 2 warps per
# program is the fastest of 1/2/4/8 tokens x 2/4/8 warps, forward (0.65 ms) and backward (2.7 ms)
TOKENS_PER_PROGRAM = 1
NUM_WARPS = 2
REDUCE_CHUNK = 32


def _pow2(n: int) -> int:
    """A tile side for n rows: the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def _dims(heads: tuple, entries: torch.Tensor, idx: torch.Tensor):
    """(B, T, H, D, N, K) from a per-head operand's shape [B, T, H, D], entries [B, N, D] and idx
    [B, T, K]; ValueError where they disagree."""
    if len(heads) != 4 or entries.dim() != 3 or idx.dim() != 3:
        raise ValueError("picked-entry attention wants a [B, T, H, D], entries [B, N, D], idx [B, T, K]")
    B, T, H, D = heads
    if entries.shape[0] != B or entries.shape[2] != D or tuple(idx.shape[:2]) != (B, T) or D < 16 or D & (D - 1):
        raise ValueError(f"shapes disagree: a {tuple(heads)}, entries {tuple(entries.shape)}, idx {tuple(idx.shape)}"
                         " (D a power of two >= 16)")
    return B, T, H, D, entries.shape[1], idx.shape[2]


def pick_index(idx: torch.Tensor, n_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The picks grouped by entry: (order [B*T*K] int32, the flat pick positions sorted by the entry
    they picked, ties in flat order; starts [B*N + 1] int32, where each entry's run begins). Picks at -1
    sort last, outside every run."""
    B = idx.shape[0]
    base = torch.arange(B, device=idx.device).view(B, 1, 1) * n_entries
    key = torch.where(idx >= 0, idx.long() + base, B * n_entries).flatten()
    order = torch.sort(key, stable=True).indices.to(torch.int32)
    counts = torch.bincount(key, minlength=B * n_entries + 1)[: B * n_entries]
    starts = torch.zeros(B * n_entries + 1, device=idx.device, dtype=torch.int32)
    starts[1:] = counts.cumsum(0)
    return order, starts


# -- kernels ------------------------------------------------------------------------------------------

@triton.jit
def _token_picks(idx_ptr, e_ptr, tok, live, T, N, K, D: tl.constexpr, KP: tl.constexpr, DT: tl.constexpr):
    """Token tok's picks: (slots j [KP], mask of real picks, their entries [KP, D] as DT, 0 if none)."""
    j = tl.arange(0, KP)
    pick = tl.load(idx_ptr + tok * K + j, mask=(j < K) & live, other=-1)
    ok = pick >= 0
    rows = ((tok // T) * N + tl.where(ok, pick, 0).to(tl.int64)) * D
    d = tl.arange(0, D)
    return j, ok, tl.load(e_ptr + rows[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(DT)


@triton.jit
def _token_heads(x_ptr, tok, hm, H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DT: tl.constexpr):
    """x[token tok] [H, D] as DT, padded to [HP, D] with 0 (rows where hm is false)."""
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    return tl.load(x_ptr + (tok * H + h[:, None]) * D + d[None, :], mask=hm[:, None], other=0.0).to(DT)


@triton.jit
def _program_token(idx_ptr, e_ptr, i, n_tok, T, N, K, H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr,
                   KP: tl.constexpr, TPP: tl.constexpr, DT: tl.constexpr):
    """This program's i-th token: (its flat index, mask of real heads, slots j, mask of real picks,
    the picked entries [KP, D])."""
    tok = tl.program_id(0).to(tl.int64) * TPP + i
    live = tok < n_tok
    j, ok, e = _token_picks(idx_ptr, e_ptr, tok, live, T, N, K, D, KP, DT)
    return tok, (tl.arange(0, HP) < H) & live, j, ok, e


@triton.jit
def _attn_fwd_kernel(q_ptr, e_ptr, idx_ptr, o_ptr, lse_ptr, s_ptr, n_tok, T, N, K, H: tl.constexpr,
                     D: tl.constexpr, HP: tl.constexpr, KP: tl.constexpr, TPP: tl.constexpr,
                     SOFTMAX: tl.constexpr, DT: tl.constexpr):
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    for i in range(TPP):
        tok, hm, j, ok, e = _program_token(idx_ptr, e_ptr, i, n_tok, T, N, K, H, D, HP, KP, TPP, DT)
        s = tl.dot(_token_heads(q_ptr, tok, hm, H, D, HP, DT), tl.trans(e))          # [HP, KP] float32
        out = hm[:, None] & (j < K)[None, :]
        if SOFTMAX:
            s = tl.where(ok[None, :], s, float("-inf"))
            m = tl.max(s, 1)
            m = tl.where(m > float("-inf"), m, 0.0)
            p = tl.exp(s - m[:, None])
            l = tl.sum(p, 1)
            o = tl.dot(p.to(DT), e) / tl.where(l > 0, l, 1.0)[:, None]                 # [HP, D]
            tl.store(o_ptr + (tok * H + h[:, None]) * D + d[None, :], o, mask=hm[:, None])
            tl.store(lse_ptr + tok * H + h, tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf")), mask=hm)
        else:
            s = tl.where(ok[None, :], s, 0.0)
        tl.store(s_ptr + (tok * H + h[:, None]) * K + j[None, :], s, mask=out)


@triton.jit
def _bwd_kernel(q_ptr, e_ptr, idx_ptr, lse_ptr, do_ptr, dlse_ptr, delta_ptr, dq_ptr, g_ptr, n_tok, T, N, K,
                H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, KP: tl.constexpr, TPP: tl.constexpr,
                SOFTMAX: tl.constexpr, DT: tl.constexpr):
    """SOFTMAX: the attention's backward (do [B, T, H, D], dlse, delta = sum_d do * o, lse); else the
    scores' (do is their gradient [B, T, H, K]). Writes dq and one gradient row per pick, g."""
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    for i in range(TPP):
        tok, hm, j, ok, e = _program_token(idx_ptr, e_ptr, i, n_tok, T, N, K, H, D, HP, KP, TPP, DT)
        q = _token_heads(q_ptr, tok, hm, H, D, HP, DT)
        if SOFTMAX:
            lse = tl.load(lse_ptr + tok * H + h, mask=hm, other=float("-inf"))
            has = lse > float("-inf")
            s = tl.dot(q, tl.trans(e))
            p = tl.where(ok[None, :] & has[:, None], tl.exp(s - tl.where(has, lse, 0.0)[:, None]), 0.0)
            do = _token_heads(do_ptr, tok, hm, H, D, HP, DT)
            shift = tl.load(dlse_ptr + tok * H + h, mask=hm, other=0.0) - tl.load(delta_ptr + tok * H + h, mask=hm,
                                                                                  other=0.0)
            ds = p * (tl.dot(do, tl.trans(e)) + shift[:, None])
            g = tl.dot(tl.trans(ds.to(DT)), q) + tl.dot(tl.trans(p.to(DT)), do)       # [KP, D]
        else:
            ds = tl.load(do_ptr + (tok * H + h[:, None]) * K + j[None, :], mask=hm[:, None] & ok[None, :], other=0.0)
            g = tl.dot(tl.trans(ds.to(DT)), q)
        tl.store(dq_ptr + (tok * H + h[:, None]) * D + d[None, :], tl.dot(ds.to(DT), e), mask=hm[:, None])
        tl.store(g_ptr + (tok * K + j[:, None]) * D + d[None, :], g, mask=ok[:, None])


@triton.jit
def _reduce_kernel(g_ptr, order_ptr, starts_ptr, out_ptr, D: tl.constexpr, CH: tl.constexpr):
    """out[entry] = sum of g's rows for the picks of this entry, in their sorted order (float32)."""
    ent = tl.program_id(0).to(tl.int64)
    lo = tl.load(starts_ptr + ent)
    hi = tl.load(starts_ptr + ent + 1)
    d = tl.arange(0, D)
    acc = tl.zeros((D,), dtype=tl.float32)
    for c in range(lo, hi, CH):
        r = c + tl.arange(0, CH)
        rows = tl.load(order_ptr + r, mask=r < hi, other=0).to(tl.int64)
        acc += tl.sum(tl.load(g_ptr + rows[:, None] * D + d[None, :], mask=(r < hi)[:, None], other=0.0).to(tl.float32), 0)
    tl.store(out_ptr + ent * D + d, acc)


# -- launchers ----------------------------------------------------------------------------------------

def run_forward(q, entries, idx, softmax: bool, tokens_per_program: int = TOKENS_PER_PROGRAM,
                num_warps: int = NUM_WARPS):
    """(o, lse, s) of the attention (softmax) or (s, s, s) of the scores; the kernel without autograd."""
    B, T, H, D, N, K = _dims(q.shape, entries, idx)
    s = torch.empty(B, T, H, K, device=q.device, dtype=torch.float32)
    o = torch.empty(B, T, H, D, device=q.device, dtype=torch.float32) if softmax else s
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32) if softmax else s
    if B * T:
        _attn_fwd_kernel[(triton.cdiv(B * T, tokens_per_program),)](
            q.contiguous(), entries.contiguous(), idx.contiguous(), o, lse, s, B * T, T, N, K, H=H, D=D, HP=_pow2(H),
            KP=_pow2(K), TPP=tokens_per_program, SOFTMAX=softmax, DT=dot_dtype(), num_warps=num_warps)
    return o, lse, s


def run_backward(q, entries, idx, order, starts, grad, lse=None, dlse=None, delta=None,
                 tokens_per_program: int = TOKENS_PER_PROGRAM, num_warps: int = NUM_WARPS):
    """(dq in q's dtype, dE in the entries' dtype): the attention's (lse given) or the scores'."""
    B, T, H, D, N, K = _dims(q.shape, entries, idx)
    dq = torch.empty(B, T, H, D, device=q.device, dtype=torch.float32)
    g = torch.empty(B, T, K, D, device=q.device, dtype=entries.dtype)
    softmax = lse is not None
    if B * T:
        _bwd_kernel[(triton.cdiv(B * T, tokens_per_program),)](
            q.contiguous(), entries.contiguous(), idx.contiguous(), lse if softmax else grad, grad.contiguous(),
            dlse if softmax else grad, delta if softmax else grad, dq, g, B * T, T, N, K, H=H, D=D, HP=_pow2(H),
            KP=_pow2(K), TPP=tokens_per_program, SOFTMAX=softmax, DT=dot_dtype(), num_warps=num_warps)
    de = torch.empty(B, N, D, device=q.device, dtype=torch.float32)
    if B * N:
        _reduce_kernel[(B * N,)](g, order, starts, de, D=D, CH=REDUCE_CHUNK)
    return dq.to(q.dtype), de.to(entries.dtype)


# -- differentiable ops (opaque to torch.compile) ----------------------------------------------------

@torch.library.custom_op("v41::picked_attention", mutates_args=())
def picked_attention(q: torch.Tensor, entries: torch.Tensor, idx: torch.Tensor, order: torch.Tensor,
                     starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, T, H, D] over each token's picked entries alone: (o [B, T, H, D],
    lse [B, T, H], scores [B, T, H, K]), all float32. (order, starts) = pick_index(idx, N)."""
    return run_forward(q, entries, idx, softmax=True)


@picked_attention.register_fake
def _(q, entries, idx, order, starts):
    B, T, H, D = q.shape
    f32 = dict(dtype=torch.float32)
    return q.new_empty(B, T, H, D, **f32), q.new_empty(B, T, H, **f32), q.new_empty(B, T, H, idx.shape[2], **f32)


def _attention_context(ctx, inputs, output):
    o, lse, _ = output
    ctx.save_for_backward(*inputs, o, lse)
    ctx.mark_non_differentiable(output[2])


def _attention_backward(ctx, do, dlse, ds_unused):
    q, entries, idx, order, starts, o, lse = ctx.saved_tensors
    do = do.float()
    delta = (do * o).sum(-1)
    dlse = torch.zeros_like(lse) if dlse is None else dlse.float()
    dq, de = _picked_backward(q, entries, idx, order, starts, do, lse, dlse.contiguous(), delta.contiguous())
    return dq, de, None, None, None


picked_attention.register_autograd(_attention_backward, setup_context=_attention_context)


@torch.library.custom_op("v41::picked_scores", mutates_args=())
def picked_scores(a: torch.Tensor, entries: torch.Tensor, idx: torch.Tensor, order: torch.Tensor,
                  starts: torch.Tensor) -> torch.Tensor:
    """a [B, T, H, D] against each token's picked entries: [B, T, H, K] float32, 0 where idx is -1."""
    return run_forward(a, entries, idx, softmax=False)[2]


@picked_scores.register_fake
def _(a, entries, idx, order, starts):
    return a.new_empty(*a.shape[:3], idx.shape[2], dtype=torch.float32)


def _scores_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scores_backward(ctx, grad):
    a, entries, idx, order, starts = ctx.saved_tensors
    da, de = _picked_backward(a, entries, idx, order, starts, grad.float().contiguous(), None, None, None)
    return da, de, None, None, None


picked_scores.register_autograd(_scores_backward, setup_context=_scores_context)


@torch.library.custom_op("v41::picked_backward", mutates_args=())
def _picked_backward(q: torch.Tensor, entries: torch.Tensor, idx: torch.Tensor, order: torch.Tensor,
                     starts: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor | None, dlse: torch.Tensor | None,
                     delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return run_backward(q, entries, idx, order, starts, grad, lse, dlse, delta)


@_picked_backward.register_fake
def _(q, entries, idx, order, starts, grad, lse, dlse, delta):
    return torch.empty_like(q), torch.empty_like(entries)
