"""The pure pieces of the training forward (engine/train/batched.py): number formats without host
syncs, the Engram rows of a batch, the functions compiled as one unit each (the attention's
projections and output side, the mHC mixes with the input's collapse, the stream's expand, the index
scores, the dense experts), and the losses beyond cross-entropy (sequence-wise expert balance, focus)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import quant
from ..model import mhc
from ..model.attention import rms_norm
from ..model.engram import EngramLayout
from ..model.moe import swiglu
from ..model.rope import rotate


NEG_INF = float("-inf")


# -- number formats without host syncs (training never meets inf/NaN on purpose) ------------------

def fp8_values(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """What an FP8 E4M3 (E8M0 per `block`) store-and-load gives, float32, same shape as x."""
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    floor = quant.pow2_scale_up(amax, quant.FP8_MAX).view(torch.int32) - (6 << 23)
    return quant.round_mantissa(groups.contiguous(), 3, floor).flatten(-2)


def fp4_values(x: torch.Tensor, block: int, scale_kind: str) -> torch.Tensor:
    """What an FP4 E2M1 store-and-load gives (scales E8M0 or E4M3 per `block`), float32."""
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(dim=-1)
    if scale_kind == "e8m0":
        scale = quant.pow2_scale_up(amax.clamp_min(quant.FP4_MAX * 2.0**-126), quant.FP4_MAX)
    else:
        scale = quant.to_e4m3(amax.clamp_min(quant.FP4_MAX * 2.0**-9) / quant.FP4_MAX).float()
    v = (groups / scale.unsqueeze(-1)).clamp(-quant.FP4_MAX, quant.FP4_MAX).contiguous()
    return (quant.round_e2m1(v) * scale.unsqueeze(-1)).flatten(-2)


def ste(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """Forward the rounded value, backward the identity."""
    return x + (rounded - x).detach()


def rotate_bt(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`rope.rotate` for [B, T, ...] tensors (rotate wants positions on the leading axis)."""
    return rotate(x.transpose(0, 1), positions, freqs, inverse).transpose(0, 1)


# -- Engram rows ------------------------------------------------------------------------------------

def engram_rows_batched(layout: EngramLayout, index: int, compressed: torch.Tensor) -> torch.Tensor:
    """`engram.ngram_rows` for B sequences that each start at position 0 and hold no dead positions.
    compressed: [B, T] long -> rows [B, T, (N-1) * heads] long, computed on compressed's device."""
    B, T = compressed.shape
    mult = layout.multipliers[index]
    rolling, columns = None, []
    for shift in range(layout.max_ngram_size):
        source = F.pad(compressed, (shift, 0), value=layout.pad_id)[:, :T]  # slots before 0 read pad
        product = source * mult[shift]
        rolling = product if rolling is None else torch.bitwise_xor(rolling, product)
        if shift == 0:
            continue
        primes = torch.tensor(layout.primes[index][shift - 1], dtype=torch.long, device=compressed.device)
        columns.append(rolling.unsqueeze(-1) % primes)
    offsets = torch.tensor(layout.offsets[index], dtype=torch.long, device=compressed.device)
    return torch.cat(columns, dim=-1) + offsets


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, mean over sequences: sum_e f_e P_e, where f_e is
    expert e's share of the sequence's (token, expert) slots times E (1 when balanced) and P_e its
    mean normalized affinity (scores / their sum per token). 1 when balanced, up to E / k when one
    set of k experts takes every token. The routing bias balances the whole batch; this term balances
    each sequence, i.e. each domain (a prose sequence whose tokens all go to code experts pays).
    scores: [B, T, E] (grad); experts: [B, T, k]."""
    B, T, E = scores.shape
    k = experts.shape[-1]
    with torch.no_grad():
        counts = torch.zeros(B, E, device=scores.device, dtype=scores.dtype).scatter_add_(
            1, experts.flatten(1), torch.ones(B, T * k, device=scores.device, dtype=scores.dtype))
        f = counts * (E / (T * k))
    P = (scores / scores.sum(-1, keepdim=True)).mean(1)                            # [B, E]
    return (f * P).sum(-1).mean()


def focus_loss(mass: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor):
    """The attention's own share on the indexer's picks, as a loss: mean over `rows` of
    -log(mass on idx / all global mass). mass: [B, T, N] (summed over heads, with grad); idx, valid:
    [B, T, k]; rows: [B, T] bool. Returns (loss, mean share) - the share is the selection recall the
    analysis probe measures, on this forward's own attention."""
    mass = mass.float()
    on_picks = mass.gather(-1, idx).masked_fill(~valid, 0.0).sum(-1)
    total = mass.sum(-1)
    rows = rows & (total > 0)
    n = rows.sum().clamp_min(1)
    log_share = (on_picks.clamp_min(1e-30).log() - total.clamp_min(1e-30).log()).masked_fill(~rows, 0.0)
    with torch.no_grad():
        share = (log_share.exp() * rows).sum() / n
    return -log_share.sum() / n, share


def attn_inputs(x, wq_a, q_norm, wq_b, wkv, kv_norm, positions, freqs, eps: float, heads: int):
    """x [B, T, dim] -> (qr [B, T, q_lora], q [B, T, H, Dh] rotated and scaled by Dh^-0.5, kv [B, T, D]
    rotated, FP8-rounded with a straight-through gradient: the window cache's form)."""
    B, T, _ = x.shape
    qr = rms_norm(x @ wq_a.t(), q_norm, eps)
    q = (qr @ wq_b.t()).view(B, T, heads, -1)
    q = rotate_bt(q, positions, freqs) * q.shape[-1] ** -0.5
    kv = rotate_bt(rms_norm(x @ wkv.t(), kv_norm, eps), positions, freqs)
    return qr, q, ste(kv, fp8_values(kv.detach(), 32))


def attn_output(o, positions, freqs, wo_a, wo_b, groups: int, rank: int):
    """The attention's output [B, T, H, D] -> [B, T, dim]: rotated back, grouped low-rank wo_a, wo_b."""
    B, T = o.shape[:2]
    o = rotate_bt(o, positions, freqs, inverse=True)
    o = torch.einsum("btgd,grd->btgr", o.reshape(B, T, groups, -1), wo_a.view(groups, rank, -1))
    return o.flatten(2) @ wo_b.t()


def routing_stats(scores, experts, seq_balance: bool):
    """(tokens routed to each expert [E], the sequence-wise balance loss or None). scores [B, T, E],
    experts [B, T, k]."""
    E = scores.shape[-1]
    load = torch.zeros(E, device=scores.device).index_add_(0, experts.flatten(),
                                                          torch.ones(experts.numel(), device=scores.device))
    return load, sequence_balance_loss(scores, experts) if seq_balance else None


def picked_ops():
    """kernels/sparse_attn_train.py, imported where first used (it imports Triton)."""
    from kernels import sparse_attn_train
    return sparse_attn_train


def hc_mixes(x, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """mhc.hc_mixes, its Sinkhorn rounds on CUDA in one Triton kernel forward and one backward
    (kernels/sinkhorn.py) instead of ~40 + ~80 small compiled ones."""
    pre, post, logits = mhc.mix_logits(x, fn, scale, base, hc, hc_eps, norm_eps)
    if logits.is_cuda and hc == 4:
        from kernels.sinkhorn import sinkhorn
        return pre, post, sinkhorn(logits.float(), iters, hc_eps)
    return pre, post, mhc.sinkhorn(logits, iters, hc_eps)


def mix_collapse(x, fn, scale, base, pre, norm_w, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """(pre, post, comb) of the stream x [N, hc, dim] and the sub-layer's input: x collapsed with the
    previous sub-layer's `pre`, then RMSNorm (`hc_mixes` and `collapse_norm` in one)."""
    return (*hc_mixes(x, fn, scale, base, hc, iters, hc_eps, norm_eps), collapse_norm(x, pre, norm_w, norm_eps))


def collapse_norm(X: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(sum_i pre[:, i] X[:, i]): mhc.collapse then the block's RMSNorm. X: [N, hc, dim]."""
    acc = pre[:, :1] * X[:, 0]
    for i in range(1, X.shape[1]):
        acc = acc + pre[:, i:i + 1] * X[:, i]
    return rms_norm(acc, weight, eps)


def expand(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mhc.expand: X'[j] = post[j] y + sum_i comb[i, j] X[i]. y: [N, dim]; X: [N, hc, dim]."""
    out = post.unsqueeze(-1) * y.unsqueeze(1)
    for i in range(X.shape[1]):
        out = out + comb[:, i, :].unsqueeze(-1) * X[:, i:i + 1]
    return out


def index_scores(dots: torch.Tensor, head_w: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Index scores [B, T, N] from the per-head dots [B, T, h, N]: sum_h w_h ReLU(dot_h), -inf where
    the entry is not visible (seen [T, N])."""
    scores = (dots.float().relu() * head_w.unsqueeze(-1)).sum(2)
    return scores.masked_fill(~seen, NEG_INF)


def experts_core(x, dense_w, w1, w2, w3, s1, s2, s3, limit: float) -> torch.Tensor:
    """Every routed expert on every token, weighted by dense_w [N, E] (0 where not chosen), plus
    the shared expert. x: [N, dim]; w1, w3: [E, inter, dim]; w2: [E, dim, inter]."""
    g = torch.einsum("nd,eid->nei", x, w1)
    u = torch.einsum("nd,eid->nei", x, w3)
    h = swiglu(g, u, limit) * dense_w.unsqueeze(-1).to(g.dtype)
    y = torch.einsum("nei,edi->nd", h, w2)
    return y + swiglu(x @ s1.t(), x @ s3.t(), limit) @ s2.t()


def compiled(fn):
    """torch.compile with static shapes; many call sites share one function, so allow recompiles."""
    import torch._dynamo as dynamo
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, key):
            setattr(dynamo.config, key, 256)
    return torch.compile(fn, dynamic=False)


def candidate_pool(scores: torch.Tensor, visible: torch.Tensor, n_blocks: int, block: int) -> torch.Tensor:
    """Layer 20's pool for [B, T, N] scores: the `n_blocks` blocks of `block` entries with the best
    max score, the block of the newest visible entry always kept (engine: select_candidate_blocks)."""
    B, T, N = scores.shape
    padded = F.pad(scores, (0, -N % block), value=NEG_INF)
    block_scores = padded.unflatten(-1, (-1, block)).amax(-1)                      # [B, T, nb]
    nb = block_scores.shape[-1]
    newest = (visible - 1).div(block, rounding_mode="floor")                        # [T]
    block_scores = block_scores.masked_fill((torch.arange(nb, device=scores.device)[None, :] == newest[:, None])[None],
                                            float("inf"))
    top, top_idx = block_scores.topk(min(n_blocks, nb), dim=-1)
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, top_idx, top > NEG_INF)
    return keep.repeat_interleave(block, dim=-1)[..., :N] & (torch.arange(N, device=scores.device) < visible[:, None])[None]
