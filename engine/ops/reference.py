"""The official reference's dtype flow (its generate.py runs with bf16 as torch's default dtype).

What is bf16 there, and rounded so here (`act`): the embedding, every RMSNorm's output, every
FP8/FP4/bf16 GEMM's output, RoPE's output, the mHC collapse and update (the residual stream), the
Engram update, the MoE's output, the sparse attention's output. What is fp32 there and here: the
mHC mixes and Sinkhorn, the router, the compressor's pooling (ratio > 1), SwiGLU, the expert sum,
the softmaxes, the logits.

GEMMs run as the reference's do, down to the last bit on this CPU (where the same product on
differently laid-out operands, or as an fp32 GEMM rounded instead of a bf16 GEMM, can differ in the
last bit, and the model amplifies one flipped bit into different picks and routes):
- FP8/FP4 GEMMs sum K in blocks of 32 in order (`gemm`), as the reference's CPU kernel;
- the bf16 GEMMs (wo_a, the index scores, weights_proj, wk) are torch bf16 GEMMs, not fp32 sums;
- the attention's window keys stay row-major [entries, D], as the reference gathers them.

Two hot spots differ by more than a final rounding:
- the indexer's scores are bf16 tensors: each head's q.k is rounded, its product with the head
  weight is rounded, and the sum over heads (accumulated in fp32) is rounded. Many scores tie.
- the sparse attention walks each query's entries in blocks of 64 (its window first, valid slots
  first, then the selected entries in position order) with an online softmax; the probabilities
  multiplying V are rounded to bf16 relative to the running max after each block, the denominator
  sums them unrounded, and the sink joins the denominator only, against the final max.
"""

from __future__ import annotations

import torch

from ..capture import capturing
from .fp32 import NEG_INF, QUANTIZED, Fp32Ops, gather_entries, rms_norm

ATTN_BLOCK = 64  # entries per step of the reference's sparse attention (its online softmax)
GEMM_BLOCK_K = 32  # the reference's FP8/FP4 GEMMs add one fp32 partial per 32 of K (kernel_cpu.py)
RUNNING_MAX_FLOOR = -1e30  # the reference's running max starts here, not at -inf
MHC_CHUNK = 128  # tokens per step of the mHC sums: [128, 4, 256] fp32 is 512 KB, so a step's tensors fit L2


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (nearest even), kept float32."""
    return x.to(torch.bfloat16).to(x.dtype)


def to_bf16_(x: torch.Tensor) -> torch.Tensor:
    """`to_bf16` in place, for a tensor the caller owns (no float32 copy)."""
    return x.copy_(x.to(torch.bfloat16))


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """x [T, n] -> mean of squares per row [T, 1], as x.square().mean(-1, keepdim=True) (each row is
    reduced alone: the same bits), a chunk of rows at a time so the squares stay in L2."""
    out = x.new_empty(x.shape[0], 1)
    squares = x.new_empty(min(MHC_CHUNK, x.shape[0]), x.shape[1])
    for a in range(0, x.shape[0], MHC_CHUNK):
        rows = x[a:a + MHC_CHUNK]
        torch.mean(torch.pow(rows, 2, out=squares[:rows.shape[0]]), -1, keepdim=True, out=out[a:a + MHC_CHUNK])
    return out


def expand_in_order(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The stream update X'[j] = sum_i comb[i, j] X[i] + post[j] y in float32, terms added in that order,
    rounded to bf16 values: residual [T, hc, dim], y [T, dim], post [T, hc], comb [T, hc, hc]."""
    T = residual.shape[0]
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)  # [T, hc, dim]
    term = residual.new_empty((min(MHC_CHUNK, T),) + residual.shape[1:])
    for a in range(0, T, MHC_CHUNK):
        r, c, mixed = residual[a:a + MHC_CHUNK], comb[a:a + MHC_CHUNK], out[a:a + MHC_CHUNK]
        t = term[:mixed.shape[0]]
        torch.mul(c[:, 0, :, None], r[:, 0, None, :], out=mixed)  # copy 0 into every copy j
        for i in range(1, residual.shape[1]):
            mixed.add_(torch.mul(c[:, i, :, None], r[:, i, None, :], out=t))
        mixed.add_(torch.mul(post[a:a + MHC_CHUNK].unsqueeze(-1), y[a:a + MHC_CHUNK].unsqueeze(1), out=t))
        to_bf16_(mixed)
    return out


def rotate_by(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., D] with its last 2 * cis.shape[-1] dims (pairs: real, imaginary) times cis [T, rd/2]
    (complex; conjugated when inverse), every value rounded to bf16 and kept float32."""
    rd = cis.shape[-1] * 2
    if inverse:
        cis = cis.conj()
    cis = cis.view((x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,))
    pairs = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    # rounded to bf16 as it is written (one rounding to nearest even, as to_bf16): two passes over x, not four
    out = x.to(torch.bfloat16, copy=True)
    out[..., -rd:] = torch.view_as_real(pairs * cis).flatten(-2)
    return out.float()


class ReferenceOps(Fp32Ops):
    name = "reference"
    tops_up_pool = True

    def __init__(self, max_seq_len: int = 65536):
        self.max_seq_len = max_seq_len  # the RoPE table's length: the config's, as the reference's
        self._rope_tables: dict = {}

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return to_bf16(x)

    # the GEMM's and the norm's fresh outputs rounded in place (no second float32 tensor), as act rounds them
    def linear(self, x: torch.Tensor, base: str, weights, act_quant: bool, round_input,
               narrow: bool = False) -> torch.Tensor:
        name = base + ".weight"
        w = weights.get(name)
        if act_quant and weights.stored_dtype(name) in QUANTIZED:
            return to_bf16_(self.gemm(round_input(x), w))
        return to_bf16_(x.float() @ w.t())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, narrow: bool = False):
        """narrow ignored (float32 out)."""
        return to_bf16_(rms_norm(x, weight, eps))

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False):
        """RoPE as complex products with polar(1, angle), as the reference rotates (its cos/sin differ
        from torch.cos/sin in the last bit), read from one table of every position up to max_seq_len
        as the reference precomputes it (polar's vector code and its tail round differently, so
        even the table's length matters to the last bit)."""
        return rotate_by(x, self._rope_table(freqs, x.device)[positions], inverse)

    def _rope_table(self, freqs: torch.Tensor, device) -> torch.Tensor:
        key = (tuple(freqs.tolist()), str(device))
        table = self._rope_tables.get(key)
        if table is None:
            angles = torch.outer(torch.arange(self.max_seq_len), freqs.float().cpu())
            table = self._rope_tables[key] = torch.polar(torch.ones_like(angles), angles).to(device)
        return table

    # the reference's bf16 GEMMs run as torch bf16 GEMMs here too (the same kernel, the same bits; an fp32
    # sum rounded to bf16 differs from it in rare last bits, enough to move picks downstream)
    def grouped_out(self, o: torch.Tensor, wo_a, name: str = "", narrow: bool = False) -> torch.Tensor:
        """o [T, g, d] x wo_a() [g, r, d] -> [T, g, r], the reference's bf16 einsum (values bf16 already);
        narrow ignored (float32 out)."""
        return torch.einsum("tgd,grd->tgr", o.bfloat16(), wo_a().bfloat16()).float()

    def bf16_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.bfloat16() @ w.bfloat16().t()).float()

    def gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w [N, K]^T as the reference's CPU FP8/FP4 kernel sums it: an fp32 product per block
        of 32 along K, added to a zero accumulator in K order. Scales are powers of two, so the
        dequantized operands give the same partials as the reference's codes scaled afterwards.
        Each block is one addmm_ (the block's whole product, then + acc, rounded once: the same bits as
        the reference's `acc += partial`, checked on this CPU) with the operands' layouts as the
        reference slices them: ~1.2-1.6x one GEMM, where a batched GEMM of the partials and separate
        adds cost 2-6x (memory traffic)."""
        acc = x.new_zeros(x.shape[0], w.shape[0])  # [M, N]
        # the same views, fewer calls
        for xs, ws in zip(x.split(GEMM_BLOCK_K, dim=1), w.t().split(GEMM_BLOCK_K, dim=0)):
            acc.addmm_(xs, ws)
        return acc

    # mHC in the reference's order of fp32 operations, so the bf16 stream rounds the same way:
    # products rounded one by one and summed over the copies in order (a BLAS dot would fuse them)
    def hc_mixes(self, x, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float):
        flat = x.flatten(1).float()
        m = (flat @ fn.float().t()) * torch.rsqrt(mean_square(flat).add_(norm_eps))
        pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
        post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
        # Sinkhorn on [i, j, T]: each sum over 4 values runs in order in either layout (the same bits,
        # tested), and in place on whole rows of T it is ~4x faster
        c = comb.permute(1, 2, 0).contiguous()
        c = c.sub_(c.amax(1, keepdim=True)).exp_()
        c.div_(c.sum(1, keepdim=True)).add_(hc_eps)                  # rows: softmax + eps
        c.div_(c.sum(0, keepdim=True).add_(hc_eps))                  # then columns
        for _ in range(iters - 1):
            c.div_(c.sum(1, keepdim=True).add_(hc_eps))
            c.div_(c.sum(0, keepdim=True).add_(hc_eps))
        return pre, post, c.permute(2, 0, 1).contiguous()

    # each product into one reused buffer, then added: the same fp32 operations, no new tensor per term;
    # a chunk of tokens at a time, so the terms, the sum and its inputs stay in L2 (elementwise: the same bits)
    def collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], x.shape[2])  # [T, dim]
        term = x.new_empty(min(MHC_CHUNK, x.shape[0]), x.shape[2])
        for a in range(0, x.shape[0], MHC_CHUNK):
            xs, ps, o = x[a:a + MHC_CHUNK], pre[a:a + MHC_CHUNK], out[a:a + MHC_CHUNK]
            t = term[:o.shape[0]]
            torch.mul(ps[:, 0, None], xs[:, 0], out=o)
            for i in range(1, x.shape[1]):
                o.add_(torch.mul(ps[:, i, None], xs[:, i], out=t))
            to_bf16_(o)
        return out

    def expand(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        return expand_in_order(y, residual, post, comb)

    def break_ties(self, scores, ranking, visible, n: int, k: int, idx, picked, tied):
        """Rows with ties pick as the reference's `topk(sorted=False)` does: torch's top-k of the bf16
        scores over the row's full width (every entry of the source, -inf where not visible or, in a
        Reindex layer, outside the pool), sorted, entries not yet visible -1. Deterministic for a
        given row, so equal scores give the reference's picks (a prefill in one chunk)."""
        if capturing():  # no host branch: every row re-picked, the untied keep theirs
            top, got = self._full_width_topk(scores, ranking, visible, n, k)
            has = tied.any(-1, keepdim=True)
            return torch.where(has, top, idx), torch.where(has, got, picked)
        rows = tied.any(-1).nonzero().squeeze(1)
        if rows.numel() == 0:
            return idx, picked
        top, got = self._full_width_topk(scores[rows], ranking[rows], visible[rows], n, k)
        idx, picked = idx.clone(), picked.clone()
        idx[rows], picked[rows] = top, got
        return idx, picked

    @staticmethod
    def _full_width_topk(scores, ranking, visible, n: int, k: int):
        """break_ties' picks for the rows given: (idx [R, k] sorted, -1 past visible; their ranking scores)."""
        width = min(n, scores.shape[1])
        if width == n:  # the whole width scored (a prefill's last block): one narrowing, no filled copy
            full = scores[:, :n].to(torch.bfloat16)
        else:
            full = torch.full((scores.shape[0], n), NEG_INF, dtype=torch.bfloat16, device=scores.device)
            full[:, :width] = scores[:, :width].to(torch.bfloat16)
        from ..model.attention import sorted_positions
        top = sorted_positions(full.topk(k, dim=-1, sorted=False).indices, n)[0]
        top = torch.where(top < visible[:, None], top, -1)
        got = ranking.gather(-1, top.clamp_min(0).clamp_max(ranking.shape[1] - 1)).masked_fill(top < 0, NEG_INF)
        return top, got

    def select_blocks(self, scores, visible, n_blocks: int, block: int, n: int) -> torch.Tensor:
        """The pool as the reference picks it: torch's topk over the bf16 block maxima of the row's
        full width n (ties between blocks are its choice), the newest visible block pinned."""
        rows = scores.shape[0]
        if scores.shape[1] >= n and n % block == 0:  # whole blocks scored: their maxima straight from the scores
            block_max = scores[:, :n].reshape(rows, -1, block).amax(-1)  # [B, nb]
        else:
            full = torch.full((rows, -(-n // block) * block), NEG_INF, device=scores.device)
            full[:, :scores.shape[1]] = scores[:, :n]
            block_max = full.view(rows, -1, block).amax(-1)
        nb = block_max.shape[1]
        newest = (visible - 1).div(block, rounding_mode="floor")
        block_max = block_max.masked_fill(torch.arange(nb, device=scores.device)[None, :] == newest[:, None],
                                          float("inf"))
        if n_blocks >= nb:  # the top-k takes every block (a context under n_blocks x block entries): no top-k
            keep = block_max.to(torch.bfloat16) > NEG_INF
        else:
            top = block_max.to(torch.bfloat16).topk(n_blocks, dim=-1)
            keep = torch.zeros(rows, nb, dtype=torch.bool, device=scores.device).scatter_(-1, top.indices,
                                                                                          top.values > NEG_INF)
        visible_now = torch.arange(n, device=scores.device)[None, :] < visible[:, None]
        if n % block == 0:  # the pool's blocks masked in place (no [B, n] repeat of the block choice)
            visible_now.view(rows, nb, block).logical_and_(keep[:, :, None])
            return visible_now
        return keep.repeat_interleave(block, dim=-1)[:, :n] & visible_now

    def index_scores(self, q: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor) -> torch.Tensor:
        B, H, D = q.shape
        # the reference's bf16 einsum, one head at a time ([B, N], never [B, H, N]); values are bf16 already
        qb, kt = q.bfloat16(), keys.bfloat16().t()
        scores = None
        for h in range(H):
            per_head = torch.mm(qb[:, h], kt).float().relu_()
            weighted = to_bf16_(per_head.mul_(head_w[:, h:h + 1]))
            scores = weighted if scores is None else scores.add_(weighted)
        return to_bf16_(scores)

    def sparse_attention(self, layer: int, q: torch.Tensor, keys: torch.Tensor, n_cached: int, window_bytes,
                         idx: torch.Tensor | None, source, sink: torch.Tensor, window: int, scale: float):
        """`Fp32Ops.sparse_attention` with the global branch's keys gathered once per block of queries:
        each query's window rows and picks, in the order `attend` walks them, by one index_select into
        one [B, n, D] buffer from one source [padded keys; global entries] (row-major, as the
        reference gathers them). The same bits as `attend` (tested); no seam copy where the window
        meets the picks, a third less memory traffic. Window-only layers keep `attend`'s views."""
        if source is None:
            return super().sparse_attention(layer, q, keys, n_cached, window_bytes, idx, source, sink, window, scale)
        from ..model.attention import query_block
        T, H, D = q.shape
        w = window
        pad = max(0, w - 1 - n_cached)
        padded = torch.cat([keys.new_zeros(pad, D), keys]) if pad else keys
        start = n_cached + pad - (w - 1)  # query i's window slot j is row start + i + j of padded
        rows = torch.cat([padded, source.kv_values])  # [P + N, D]: the keys, then the global entries
        picks, padding = idx.clamp_min(0) + padded.shape[0], idx < 0  # rows of the picks in `rows`
        key_rows = torch.arange(n_cached, n_cached + T, device=q.device)  # positions as attend reads them
        slots = torch.arange(w, device=q.device)
        block = query_block(q.device)
        out, buf = [], None
        for a in range(0, T, block):
            b = slice(a, a + block)
            positions = key_rows[b]
            B = positions.shape[0]
            first = start + a + torch.arange(B, device=q.device)  # [B]: each query's slot-0 row
            if int(positions[0]) < w - 1:  # attend's roll: valid slots first
                shift = (w - 1 - positions).clamp_min(0)
                win_idx = first[:, None] + (slots[None, :] + shift[:, None]) % w  # [B, W]
                empty = slots[None, :] > positions[:, None]
            else:
                win_idx = first[:, None] + slots[None, :]
                empty = torch.zeros(B, w, dtype=torch.bool, device=q.device)
            n_win = min(w, int(positions[-1]) + 1)
            index = torch.cat([win_idx[:, :n_win], picks[b]], dim=1)  # [B, n]
            n = index.shape[1]
            if buf is None or buf.shape[0] != B * n:
                buf = rows.new_empty(B * n, D)
            gathered = torch.index_select(rows, 0, index.flatten(), out=buf).view(B, n, D)
            invalid = torch.cat([empty[:, :n_win], padding[b]], dim=1)
            out.append(self._online_softmax(q[b], lambda lo, hi: gathered[:, lo:hi], n, invalid, sink, scale)[0])
        return torch.cat(out)

    def attend(self, q: torch.Tensor, positions: torch.Tensor, windows: torch.Tensor, sink: torch.Tensor,
               idx, global_kv: torch.Tensor | None, window_size: int, scale: float, probs: bool = False):
        B, H, D = q.shape
        w = window_size
        if int(positions[0]) < w - 1:
            # the reference lists an early query's window valid slots first (slot j = position j):
            # roll those rows so the blocks of 64 hold the same entries. Gathered row-major [B, W, D], as the
            # reference gathers its keys: the QK GEMM's last bits depend on the keys' layout on this CPU
            shift = (w - 1 - positions).clamp_min(0)
            cols = (torch.arange(w, device=q.device)[None, :] + shift[:, None]) % w  # [B, W]
            win_rows = windows.transpose(1, 2).gather(1, cols[:, :, None].expand(-1, -1, windows.shape[1]))
            empty = torch.arange(w, device=q.device)[None, :] > positions[:, None]
        else:
            win_rows = windows.transpose(1, 2)  # [B, W, D], a row-major view of the unfolded keys
            empty = torch.zeros(B, w, dtype=torch.bool, device=q.device)
        # a prompt shorter than the window lists only its own length of slots
        n_win = min(w, int(positions[-1]) + 1)
        win_keys = win_rows[:, :n_win]  # [B, n_win, D]
        gathered = gather_entries(global_kv, idx) if global_kv is not None else win_keys[:, :0]
        invalid = torch.cat([empty[:, :n_win], idx[1]] if global_kv is not None else [empty[:, :n_win]], dim=1)
        n = n_win + gathered.shape[1]  # each query's entries in the reference's order: window, then picks

        def block_keys(a: int, b: int) -> torch.Tensor:  # [B, b - a, D]; copied only across the seam
            if b <= n_win:
                return win_keys[:, a:b]
            if a >= n_win:
                return gathered[:, a - n_win:b - n_win]
            return torch.cat([win_keys[:, a:], gathered[:, :b - n_win]], dim=1)

        return self._online_softmax(q, block_keys, n, invalid, sink, scale, n_win if global_kv is not None and probs
                                    else None)

    @staticmethod
    def _online_softmax(q: torch.Tensor, block_keys, n: int, invalid: torch.Tensor, sink: torch.Tensor, scale: float,
                        probs_from: int | None = None):
        """The reference's online softmax over each query's n entries, one block of 64 at a time (keys
        block_keys(a, b) -> [B, b - a, D], invalid [B, n]): the probabilities that multiply V are bf16
        against the running max, the denominator sums them unrounded, the sink joins it at the end.
        -> (out [B, H, D] bf16-valued; with probs_from, each entry's share of the final softmax from
        that entry on [B, H, n - probs_from], else None)."""
        B, H, D = q.shape
        running = torch.full((B, H), RUNNING_MAX_FLOOR, device=q.device)
        acc = torch.zeros(B, H, D, device=q.device)
        denom = torch.zeros(B, H, device=q.device)
        blocks = []
        for a in range(0, n, ATTN_BLOCK):
            kb = block_keys(a, min(n, a + ATTN_BLOCK))
            s = torch.bmm(q, kb.transpose(1, 2)).masked_fill_(invalid[:, None, a:a + ATTN_BLOCK], NEG_INF).mul_(scale)
            new = torch.maximum(running, s.amax(-1))
            rescale = torch.exp(running - new)
            p = s.sub_(new.unsqueeze(-1)).exp_()
            denom = denom * rescale + p.sum(-1)
            pb = to_bf16_(p)
            acc.mul_(rescale.unsqueeze(-1)).add_(torch.bmm(pb, kb))
            if probs_from is not None:
                blocks.append((pb, new))
            running = new
        denom = denom + torch.exp(sink.float().view(1, -1) - running)
        o = to_bf16_(acc.div_(denom.unsqueeze(-1)))
        if probs_from is None:
            return o, None
        # the probe: each global entry's share of the final softmax
        share = torch.cat([pb * torch.exp(m - running).unsqueeze(-1) for pb, m in blocks], dim=-1)[..., probs_from:]
        return o, share / denom.unsqueeze(-1)
