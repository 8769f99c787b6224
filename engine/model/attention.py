"""CSA2 attention for every role: sliding window + (for ratio > 0) selected entries of a global KV.

One chunk of tokens at a time (a whole prompt, or one decode step): prefill and decode are the
same code, so they agree by construction up to float summation order.

Caches live in the release formats: the window in FP8 (E4M3, E8M0 per 32), the global KV in FP4
(E2M1, E4M3 scale per 16), the index keys in FP4 (E8M0 per 32). A dequantized mirror of each is
kept beside it for compute; `nbytes` counts only the stored formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.nn.functional as F

from .. import quant
from ..capture import capturing
from ..config import ModelConfig
from ..roles import FULL, REINDEX, LayerRole
from .graphs import called
from .rope import layer_freqs, rotate
from .selection_probe import runner_ups, selection_recall

NEG_INF = float("-inf")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def ste(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """Forward the rounded value, backward the identity (straight-through), so training sees the
    same quantization noise as inference."""
    return x + (rounded - x).detach() if x.requires_grad else rounded


@dataclass
class WindowCache:
    """The last `window_size` KV latents of one layer, FP8."""
    q: torch.Tensor | None = None        # float8_e4m3fn [n, D]
    scale: torch.Tensor | None = None    # float8_e8m0fnu [n, D/32]
    values: torch.Tensor | None = None   # float32 mirror [n, D]

    def nbytes(self) -> int:
        if self.q is None:
            return 0
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


GROWTH = 1.5  # a source buffer's room when it fills: amortized O(1) copies per entry appended


def appended(buf: torch.Tensor | None, n: int, new: torch.Tensor) -> torch.Tensor:
    """Rows buf[:n] followed by `new`, in a buffer with room to spare: written in place while there is room,
    else copied once into a buffer GROWTH times larger (a decode step appends one entry: no copy of the whole
    cache a step). Under autograd (training) a plain concatenation: an in-place write would change tensors
    the backward pass saved."""
    k = new.shape[0]
    if torch.is_grad_enabled() and new.requires_grad:
        return new if buf is None or n == 0 else torch.cat([buf[:n], new])
    if buf is None or n + k > buf.shape[0] or buf.requires_grad \
            or (buf.is_inference() and not torch.is_inference_mode_enabled()):  # not writable here
        room = max(n + k, int(GROWTH * n), 16)
        grown = new.new_empty((room, *new.shape[1:]))
        if n:
            grown[:n] = buf[:n]
        buf = grown
    buf[n:n + k] = new.detach()
    return buf


@dataclass
class SourceCache:
    """What a Full layer publishes: compressed KV entries and index keys (FP4), their float mirrors, plus the
    pending tokens of an incomplete group (m > 1). The first `n_entries` rows of each buffer hold the
    entries; the rest is room for the next ones (`appended`), so a view of the first n rows (a snapshot)
    stays what it was while later entries are written after it."""
    ratio: int
    n_entries: int = 0
    buffers: dict = field(default_factory=dict)      # kv_packed int8 [., D/2], kv_scale e4m3 [., D/16],
    # ik_packed int8 [., Di/2], ik_scale e8m0 [., Di/32], kv_values float32 [., D], ik_values float32 [., Di]
    pending_kv: torch.Tensor | None = None          # [r, D] fp32, r < ratio
    pending_score: torch.Tensor | None = None

    def _rows(self, name: str) -> torch.Tensor | None:
        buf = self.buffers.get(name)
        return None if buf is None else buf[: self.n_entries]

    @property
    def kv_values(self) -> torch.Tensor | None:
        """float32 mirror [N, D] of the stored KV entries (rotated)."""
        return self._rows("kv_values")

    @property
    def ik_values(self) -> torch.Tensor | None:
        """float32 mirror [N, Di] of the stored index keys (rotated)."""
        return self._rows("ik_values")

    def global_nbytes(self) -> int:
        """Bytes of the stored formats of the entries (not of the room after them)."""
        return sum(t.numel() * t.element_size() for t in self.packed()) if self.n_entries else 0

    def pending_nbytes(self) -> int:
        if self.pending_kv is None:
            return 0
        return 2 * self.pending_kv.numel() * 4

    def packed(self) -> tuple[torch.Tensor, ...]:
        """The stored bytes: (kv int8 [N, D/2], kv e4m3 [N, D/16], index keys int8 [N, Di/2], e8m0 [N, Di/32])."""
        return tuple(self._rows(name) for name in ("kv_packed", "kv_scale", "ik_packed", "ik_scale"))

    def snapshot(self) -> "SourceCache":
        """The entries as they are now, unaffected by later appends (a later chunk may append
        while this chunk's upper layers still read them: engine/run/pipeline.py)."""
        return replace(self, buffers=dict(self.buffers))

    def append(self, kv: torch.Tensor, ik: torch.Tensor, quantize=quant.quantize_fp4_with_values) -> None:
        """Store new entries: kv [n, D] (rotated), ik [n, Di] (rotated index keys); quantize: the FP4 store
        (engine/ops quantize_fp4_with_values)."""
        kv_p, kv_s, kv_loaded = quantize(kv, 16, "e4m3")
        ik_p, ik_s, ik_loaded = quantize(ik, 32, "e8m0")
        new = {"kv_packed": kv_p, "kv_scale": kv_s, "ik_packed": ik_p, "ik_scale": ik_s,
               "kv_values": ste(kv, kv_loaded), "ik_values": ste(ik, ik_loaded)}
        n = self.n_entries
        self.buffers = {name: appended(self.buffers.get(name), n, rows) for name, rows in new.items()}
        self.n_entries = n + kv.shape[0]


@dataclass
class Shared:
    """What layers hand up the stack within one forward: the latest sources' caches, the latest
    top-k (and its scores), and the candidate pool."""
    source: SourceCache | None = None
    topk: torch.Tensor | None = None         # [T, k] entry indices, -1 padded
    topk_scores: torch.Tensor | None = None  # [T, k]
    candidates: torch.Tensor | None = None   # [T, N] bool
    topk_kth: torch.Tensor | None = None     # [T] the k-th pick's score (-inf: fewer than k picks)
    topk_tied: torch.Tensor | None = None    # [T, k] bool: picks another entry with the same score could replace


class LayerWeights:
    """Float weights of one layer's attention, fetched by name from a weight source."""

    def __init__(self, get, prefix: str):
        self.get, self.prefix = get, prefix

    def __call__(self, name: str) -> torch.Tensor:
        return self.get(f"{self.prefix}{name}")


QUERY_BLOCK = 512  # queries scored at once: bounds memory at [block, entries]
CPU_QUERY_BLOCK = 256  # on the CPU: 2.5x faster than 512 (a block's scores stay in cache), and few ops


def query_block(device: torch.device) -> int:
    return min(QUERY_BLOCK, CPU_QUERY_BLOCK) if device.type == "cpu" else QUERY_BLOCK


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last axis with ties going to the lower index (a full stable sort; use it
    for short rows such as block scores)."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def sorted_positions(idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort position rows (values in [-1, n]) ascending -> (sorted int64, the sort's order). Sorted as the
    narrowest integer that holds n: torch's radix sort makes one pass per key byte (an int64 [64, 512]
    sort: 26 us on the H200, int16 14 us; a decode step sorts several)."""
    narrow = torch.int16 if n < torch.iinfo(torch.int16).max else torch.int32
    values, order = idx.to(narrow).sort(dim=-1)
    return values.long(), order


def compact_positions(mask: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of each row's True entries (at most k a row), ascending, in k slots; n (the row
    length) in the slots left. Equal to the k smallest of where(mask, position, n), without a top-k
    (an int64 top-k of [64, 4K] positions: 58 us on the H200; this is a scan and a scatter)."""
    b, n = mask.shape
    rank = mask.cumsum(-1, dtype=torch.int32)
    slot = torch.where(mask & (rank <= k), rank - 1, k).long()  # every unchosen entry into a spare slot k
    out = torch.full((b, k + 1), n, dtype=torch.long, device=mask.device)
    out.scatter_(1, slot, torch.arange(n, device=mask.device).expand(b, n))
    return out[:, :k]


def topk_in_position_order(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best finite entries of each row, listed in position order, -1 padded at the end.
    Ties at the k-th value go to the lower positions, so a prompt run whole and token by token
    selects the same entries. scores: [T, N] -> (indices [T, k], their scores [T, k])."""
    values, indices = scores.topk(k, dim=-1)
    kth = values[:, -1:]
    # a row with k finite picks and no unpicked entry tied with the k-th is settled by sorting its
    # picks; the others (FP4 scores often tie, e.g. at 0) take the tie-aware path
    settled = (kth[:, 0] > NEG_INF) & ((scores == kth).sum(-1) == (values == kth).sum(-1))
    idx, order = sorted_positions(indices, scores.shape[-1])
    picked = values.gather(-1, order)
    if capturing():  # no host branch: every row through the tie-aware path, the settled keep theirs
        tie_idx, tie_picked = _topk_with_ties(scores, kth, k)
        keep = settled[:, None]
        return torch.where(keep, idx, tie_idx), torch.where(keep, picked, tie_picked)
    if not bool(settled.all()):
        rows = (~settled).nonzero().squeeze(1)
        idx[rows], picked[rows] = _topk_with_ties(scores[rows], kth[rows], k)
    return idx, picked


def tie_marks(scores: torch.Tensor, idx: torch.Tensor, picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a top-k leaves to chance. scores [B, N] (the ranking the picks came from), idx and
    picked [B, k] (-1 / -inf padded) -> (the k-th pick's score [B], -inf when a row has fewer than
    k picks; tied [B, k]: picks whose score equals it while more entries share that score than
    were picked, so which of them a top-k takes is arbitrary: the reference's `topk(sorted=False)`
    may take others)."""
    valid = idx >= 0
    if picked.shape[-1] == 0:
        return picked.new_full((picked.shape[0],), NEG_INF), valid
    kth = torch.where(valid.all(-1), picked.masked_fill(~valid, float("inf")).amin(-1), NEG_INF)
    at_kth = (picked == kth[:, None]) & valid
    sharing = (scores == kth[:, None]).sum(-1)  # entries with the k-th score (never -inf ones: kth > -inf)
    tied = at_kth & (sharing > at_kth.sum(-1))[:, None]
    return kth, tied


# a visible entry outside a Reindex layer's candidate pool: scored -inf, but still pickable, below every
# finite score (the reference's topk takes such entries when the pool holds fewer than index_topk)
OUTSIDE_POOL = torch.finfo(torch.float32).min


def _topk_with_ties(scores: torch.Tensor, kth: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_in_position_order` for rows given their k-th best value: everything above it, then
    the lowest-positioned entries equal to it (never -inf ones)."""
    n = scores.shape[-1]
    above = scores > kth
    ties = (scores == kth) & (kth > NEG_INF)
    need = k - above.sum(-1, keepdim=True)
    chosen = above | (ties & (ties.cumsum(-1) <= need))
    idx = compact_positions(chosen, k)
    picked = scores.gather(-1, idx.clamp(max=n - 1))
    missing = idx >= n
    return idx.masked_fill(missing, -1), picked.masked_fill(missing, NEG_INF)


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, n_blocks: int, block: int) -> torch.Tensor:
    """Level one of the two-level top-k: per query keep the `n_blocks` blocks (of `block` entries)
    with the best max score, always keeping the block of its newest visible entry.
    scores: [T, N] with invisible entries at -inf; visible: [T] entry counts. Returns bool [T, N],
    True on the visible entries of the kept blocks."""
    n = scores.shape[-1]
    padded = F.pad(scores, (0, -n % block), value=NEG_INF)
    block_scores = padded.unflatten(-1, (-1, block)).amax(-1)  # [T, nb]
    nb = block_scores.shape[-1]
    newest = (visible - 1).div(block, rounding_mode="floor")
    block_scores = block_scores.masked_fill(torch.arange(nb, device=scores.device)[None, :] == newest[:, None], float("inf"))
    if n_blocks >= nb:  # every block is a top block (a context under n_blocks x block entries): no sort
        keep = block_scores > NEG_INF
    else:
        top_values, top_indices = stable_topk(block_scores, n_blocks)
        keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, top_indices, top_values > NEG_INF)
    # a kept block's entries past the query's newest visible one are not in its pool
    return keep.repeat_interleave(block, dim=-1)[:, :n] & (torch.arange(n, device=scores.device) < visible[:, None])


class Compressor:
    """A Full layer's compressor: every `ratio` tokens become one global KV entry (ratio 1: one per
    token; ratio 2: a softmax-gated pool of the pair, per channel), RMS-normalized and rotated at the
    group's first position, stored in FP4 with its index key (the indexer's `wk` of the same latent).
    A group still incomplete waits in the source's pending rows for the next chunk."""

    def __init__(self, cfg: ModelConfig, ratio: int, weights: LayerWeights, ops, freqs: torch.Tensor):
        self.cfg, self.ratio, self.w, self.ops, self.freqs = cfg, ratio, weights, ops, freqs
        self.source = SourceCache(ratio)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        """Pool new complete groups of `ratio` tokens into entries and publish them."""
        cfg, src, m = self.cfg, self.source, self.ratio
        ops = self.ops
        # ratio 1: a bf16 GEMM in the reference; ratio > 1: fp32 weights, pooled in fp32
        kv = ops.bf16_linear(x, self.w("attn.compressor.wkv.weight")) if m == 1 else \
            ops.f32_linear(x, self.w("attn.compressor.wkv.weight"))
        if m > 1:
            score = ops.f32_linear(x, self.w("attn.compressor.wgate.weight"))
            if src.pending_kv is not None:
                kv, score = torch.cat([src.pending_kv, kv]), torch.cat([src.pending_score, score])
            n_groups = kv.shape[0] // m
            cut = n_groups * m
            src.pending_kv = kv[cut:].detach() if cut < kv.shape[0] else None
            src.pending_score = score[cut:].detach() if cut < kv.shape[0] else None
            if n_groups == 0:
                return
            kv = kv[:cut].unflatten(0, (n_groups, m))
            weights = torch.softmax(score[:cut].unflatten(0, (n_groups, m)), dim=1)  # per channel over the group
            kv = (kv * weights).sum(dim=1)  # pooled in fp32 (so in the reference too), then stored
        latent = ops.rms_norm(ops.act(kv), self.w("attn.compressor.norm.weight"), cfg.norm_eps)  # [n, D], pre-RoPE
        first = torch.arange(src.n_entries, src.n_entries + latent.shape[0], device=x.device) * m  # group's first position
        ik = ops.rms_norm(ops.bf16_linear(latent, self.w("attn.indexer.wk.weight")), self.w("attn.indexer.k_norm.weight"),
                          cfg.norm_eps)
        src.append(ops.rotate(latent, first, self.freqs), ops.rotate(ik, first, self.freqs),
                   ops.quantize_fp4_with_values)


class Indexer:
    """The lightning indexer of a Full or Reindex layer: per query, sum over index heads of
    w_h relu(q_h . k) against the source's FP4 index keys, and the top-k entries in position order
    (inside the candidate pool above the candidate source, which publishes that pool). Ties at the
    k-th score are marked, and broken as the numerics say (engine/ops break_ties). The ops score and
    pick (`ops.index_topk`: `index_picks` here, or the kernels of engine/ops/triton.py); both hand each
    block of scores to `settle` and the outcome to `took`."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, weights: LayerWeights, linear, ops, parallel, freqs):
        self.cfg, self.role, self.w, self.linear, self.ops, self.parallel = cfg, role, weights, linear, ops, parallel
        self.ratio, self.freqs = role.compress_ratio, freqs
        self.detail = False  # runner-ups for this forward (ProbeRequest.detail)
        self.runners = None
        self.ties = (None, None)  # (k-th score [T], tied picks [T, k]) of the last top-k (tie_marks)

    def forward(self, x, qr, positions, src: SourceCache, shared: Shared, pieces=None):
        """Indexer scores over the source's entries and the top-k per query (position order),
        one block of queries at a time. pieces: as Block.forward's (the queries have no cache)."""
        q, head_w = (pieces or called)(self.role.layer, "index_queries", self.queries, x, qr, positions)
        return self.ops.index_topk(self, q, head_w, positions, src, shared)

    def queries(self, x, qr, positions):
        """The index queries, rotated, [T, Hi, Di] and their head weights [T, Hi]."""
        cfg = self.cfg
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        local_hi = hi if self.parallel is None else self.parallel.local(hi, "index heads")  # this rank's heads
        # narrow: the kernel ops' bf16 GEMM output as it is (their RoPE and FP4 quantizer read it; no 4K
        # prefill's 54 us widening copy, H100 run 31f)
        q = self.linear(qr, "attn.indexer.wq_b", narrow=True).view(-1, local_hi, di)
        q = self.ops.rotate(q, positions, self.freqs)
        # weights_proj is a bf16 GEMM in the reference, and its scaled output is bf16 too
        head_w = self.ops.act(self.ops.bf16_linear(x, self.w("attn.indexer.weights_proj.weight")) * (di ** -0.5 * hi ** -0.5))
        return q, head_w

    def index_picks(self, q, head_w, positions, src: SourceCache, shared: Shared):
        """The indexer's picks from rotated queries q [T, Hi, Di] (FP4-rounded here, as the index keys)
        and head weights [T, Hi]: scores per block of queries, top-k in position order, ties marked."""
        cfg, m = self.cfg, self.ratio
        q = ste(q, quant.fp4_roundtrip(q, 32, "e8m0"))
        keys = src.ik_values  # [N, Di]
        n = keys.shape[0]
        k = min(cfg.index_topk, n)
        visible = (positions + 1).div(m, rounding_mode="floor")  # entries each query may see
        entry = torch.arange(n, device=q.device)
        if self.role.candidate_source:
            shared.candidates = torch.zeros(q.shape[0], n, dtype=torch.bool, device=q.device)
        keep_scores = torch.is_grad_enabled()  # the indexer's training loss needs them all
        all_scores, idx, picked, runners, kths, tieds = [], [], [], [], [], []
        block = query_block(q.device)
        for a in range(0, q.shape[0], block):
            b = slice(a, a + block)
            # entries past the block's last query are invisible to all of it: score the visible
            # prefix only (about half the work over a prompt); training's loss wants whole rows
            width = n if keep_scores or self.parallel is not None else max(1, min(n, int(visible[b].max())))
            scores = self.ops.index_scores(q[b], keys[:width], head_w[b])  # [block, width]
            if self.parallel is not None:  # partial sums over each rank's heads, before any top-k
                scores = self.parallel.all_reduce(scores)
            scores = scores.masked_fill(entry[None, :width] >= visible[b, None], NEG_INF)
            if self.role.candidate_source:
                shared.candidates[b, :width] = self.ops.select_blocks(
                    scores.detach(), visible[b], cfg.candidate_topk_blocks, cfg.candidate_block_size, n)[:, :width]
            elif self.role.in_candidate_pool:
                scores = scores.masked_fill(~shared.candidates[b, :width], NEG_INF)
            if width < k:  # early queries: fewer entries than picks, the rest is -1 padding
                scores = F.pad(scores, (0, k - width), value=NEG_INF)
            block_idx, block_picked, block_kth, block_tied = self.settle(scores, visible[b], n, k)
            kths.append(block_kth)
            tieds.append(block_tied)
            if self.detail:
                runners.append(runner_ups(scores, block_idx))
            idx.append(block_idx)
            picked.append(block_picked)
            if keep_scores:
                all_scores.append(scores)
        idx, picked = torch.cat(idx), torch.cat(picked)
        self.took(idx, (torch.cat(kths), torch.cat(tieds)), tuple(map(torch.cat, zip(*runners))) if runners else None,
                  torch.cat(all_scores) if keep_scores else None)
        return idx, picked

    def ranking(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """What the top-k ranks, from one block's scores [B, N'] (-inf: not visible or outside the pool):
        the scores, or, in a layer whose numerics top a short candidate pool up, the scores with the
        visible entries outside the pool at OUTSIDE_POOL (pickable, below every finite score, tied)."""
        ranking = scores.detach()
        if self.role.in_candidate_pool and self.ops.tops_up_pool:
            outside = (ranking == NEG_INF) & (torch.arange(ranking.shape[1], device=ranking.device)[None, :] < visible[:, None])
            ranking = ranking.masked_fill(outside, OUTSIDE_POOL)
        return ranking

    def settle(self, scores: torch.Tensor, visible: torch.Tensor, n: int, k: int, picks=None, ranking=None):
        """One block of queries from its scores [B, N'] (-inf: not visible or outside the pool) to its
        picks, whichever ops scored them: the top-k in position order of `ranking` (self.ranking), or
        `picks` = (idx, picked) [B, k] a kernel already took from that ranking, the tie marks (tie_marks),
        and the numerics' choice among ties (ops.break_ties).
        -> (idx [B, k], picked [B, k], k-th score [B], tied [B, k])."""
        ranking = self.ranking(scores, visible) if ranking is None else ranking
        block_idx, block_picked = topk_in_position_order(ranking, k) if picks is None else picks
        block_kth, block_tied = self.ops.tie_marks(ranking, block_idx, block_picked)
        return self.resolve_ties(scores, ranking, visible, n, k, block_idx, block_picked, block_kth, block_tied)

    def resolve_ties(self, scores, ranking, visible, n: int, k: int, block_idx, block_picked, block_kth, block_tied):
        """settle's second half: the numerics' choice among the tied picks (ops.break_ties), re-marked. Rows
        are independent, so it takes any number of blocks at once (the kernel ops: once a prefill, one host
        read of which rows tie instead of one a block)."""
        top_up = self.role.in_candidate_pool and self.ops.tops_up_pool
        # who takes a tie is the numerics' choice (the reference: torch's topk over the whole row)
        chosen = self.ops.break_ties(scores.detach(), ranking, visible, n, k, block_idx, block_picked, block_tied)
        if chosen[0] is not block_idx:  # re-picked rows: their picks at the old k-th score stay marked tied
            had = block_tied.any(-1, keepdim=True)
            block_idx, block_picked = chosen
            retied = had & (block_picked == block_kth[:, None]) & (block_idx >= 0)
            block_kth, block_tied = self.ops.tie_marks(ranking, block_idx, block_picked)
            block_tied = block_tied | retied
        if top_up:
            block_picked = block_picked.masked_fill(block_picked == OUTSIDE_POOL, NEG_INF)
            block_kth = block_kth.masked_fill(block_kth == OUTSIDE_POOL, NEG_INF)
        return block_idx, block_picked, block_kth, block_tied

    def took(self, idx: torch.Tensor, ties, runners, scores: torch.Tensor | None) -> None:
        """What the last top-k leaves for the probes and training: the picks idx [T, k] (the indexer's
        training loss), ties (k-th score [T], tied [T, k]), runner-ups (detail probes, or None) and the
        scores [T, N] (None unless training needs them)."""
        self.ties, self.runners, self.index_scores, self.last_topk = ties, runners, scores, idx


class Attention:
    """One layer's attention. `forward` takes the normalized input x [T, dim] at `positions` and
    returns [T, dim]; it reads and updates the layer's caches and the shared hand-down state."""

    def __init__(self, cfg: ModelConfig, role: LayerRole, weights: LayerWeights, linear, ops, parallel=None):
        self.cfg, self.role, self.w, self.linear = cfg, role, weights, linear
        self.ops = ops  # engine/ops: the numerics and kernels, chosen once (`linear` stores by them too)
        self.parallel = parallel  # engine/serve/parallel.py; None in one process
        self.ratio = role.compress_ratio
        self.freqs = layer_freqs(cfg, self.ratio)
        self.window = WindowCache()
        self.compressor = Compressor(cfg, self.ratio, weights, self.ops, self.freqs) if role.role == FULL else None
        self.indexer = Indexer(cfg, role, weights, linear, self.ops, parallel, self.freqs) \
            if role.role in (FULL, REINDEX) else None
        self.detail = False  # set per forward (ProbeRequest.detail): runner-ups and recall probes

    @property
    def source(self) -> SourceCache | None:
        """The global KV and index keys this layer publishes (Full layers)."""
        return self.compressor.source if self.compressor is not None else None

    # -- the pieces -------------------------------------------------------------------------
    def _local_heads(self) -> tuple[int, int]:
        """(heads, output groups) this process computes: all of them, or this rank's."""
        if self.parallel is None:
            return self.cfg.n_heads, self.cfg.o_groups
        return self.parallel.local(self.cfg.n_heads, "heads"), self.parallel.local(self.cfg.o_groups, "groups")

    def queries(self, x: torch.Tensor, positions: torch.Tensor):
        """The query side: the normalized q_a (qr, which the indexer reads too) and the rotated heads [T, H, hd]
        (bf16 where the ops keep the GEMM's bf16 output: the RoPE and the attention take it as it is)."""
        cfg = self.cfg
        # narrow: the norms read a bf16 input as it is (a 4K prefill's 14 + 6 us widenings, run 30f)
        qr = self.ops.rms_norm(self.linear(x, "attn.wq_a", narrow=True), self.w("attn.q_norm.weight"), cfg.norm_eps)
        q = self.linear(qr, "attn.wq_b", narrow=True).view(-1, self._local_heads()[0], cfg.head_dim)
        return qr, self.ops.rotate(q, positions, self.freqs)

    def window_entries(self, x: torch.Tensor, positions: torch.Tensor, keep_bytes: bool = False):
        """The chunk's window entries: the KV latents (normalized, rotated, FP8-rounded) [T, D] and the FP8 bytes
        and scales the cache stores (every row's with keep_bytes, the kernel path; else the last window's)."""
        cfg = self.cfg
        kv = self.ops.rms_norm(self.linear(x, "attn.wkv", narrow=True), self.w("attn.kv_norm.weight"), cfg.norm_eps)
        kv = self.ops.rotate(kv, positions, self.freqs)
        q8, s8 = self.ops.quantize_fp8(kv if keep_bytes else kv[-cfg.window_size:], 32)
        return ste(kv, self.ops.fp8_roundtrip(kv, 32)), q8, s8

    def _window_kv(self, x: torch.Tensor, positions: torch.Tensor, keep_bytes: bool = False, entries=None):
        """The window cache extended by the chunk's entries (`window_entries`, or `entries` made already)
        -> the keys the chunk's queries see [cached + T, D]."""
        cfg = self.cfg
        kv, q8, s8 = self.window_entries(x, positions, keep_bytes) if entries is None else entries
        win = self.window
        keys = kv if win.values is None else torch.cat([win.values, kv])
        # keep only what a later query can still see
        keep = slice(-cfg.window_size, None)
        all_q = q8 if win.q is None else torch.cat([win.q, q8])
        all_s = s8 if win.scale is None else torch.cat([win.scale, s8])
        # kernel path: the FP8 bytes of every key this chunk's queries see, for sparse attention
        self.window_bytes = (all_q, all_s) if keep_bytes else None
        win.q, win.scale = all_q[keep], all_s[keep]
        win.values = keys[keep].detach()
        return keys

    def output(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The heads' outputs o [T, H, hd] back to the stream: the inverse rotation, the grouped wo_a, wo_b
        -> [T, dim] (this rank's partial sum when parallel)."""
        cfg = self.cfg
        n_heads, groups = self._local_heads()
        o = self.ops.rotate(o, positions, self.freqs, inverse=True)
        # the float wo_a only when the ops ask for it: the kernel ops keep its bf16 value (a fresh float32
        # dequantization of 33.5M values per step cost ~0.15 ms of a 64-token decode step, H200)
        o = self.ops.grouped_out(o.reshape(-1, groups, n_heads // groups * cfg.head_dim),
                                 lambda: self.w("attn.wo_a.weight").view(groups, cfg.o_lora_rank, -1),
                                 self.w.prefix + "attn.wo_a", narrow=True)
        # narrow: its one consumer, the mHC update, reads a bf16 y as it is (the parallel engine's all-reduce
        # widens its partial sums, bf16 values either way)
        return self.linear(o.flatten(1), "attn.wo_b", narrow=True)

    def publish(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        """A Full layer's global KV and index keys for x [T, dim] (normalized input) at `positions`,
        without attending: a CED prefill's prompt rows before the decoder's replay (engine/run/ced.py)."""
        self.compressor.forward(x, positions)

    def _attend(self, q, positions, windows, sink, idx, global_kv):
        """`ops.attend` for a q already scaled by 1/sqrt(head_dim) (tests call it so)."""
        return self.ops.attend(q, positions, windows, sink, idx, global_kv, self.cfg.window_size, 1.0)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: torch.Tensor, shared: Shared, probe: dict | None, pieces=None):
        """pieces: as Block.forward's, for the parts without caches (queries, window entries, output)."""
        cfg, L = self.cfg, self.role.layer
        run = pieces or called
        qr, q = run(L, "queries", self.queries, x, positions)
        keep_bytes = self.ops.keeps_window_bytes(L)
        entries = run(L, f"window_entries_{int(keep_bytes)}", partial(self.window_entries, keep_bytes=keep_bytes),
                      x, positions)
        keys = self._window_kv(x, positions, keep_bytes, entries)
        idx = None
        if self.ratio > 0:
            if self.role.role == FULL:
                self.compressor.forward(x, positions)
                shared.source = self.source.snapshot()
            src = shared.source
            if self.role.role in (FULL, REINDEX):
                if src.n_entries == 0:
                    idx = torch.full((x.shape[0], 0), -1, dtype=torch.long, device=x.device)
                    picked = torch.zeros(x.shape[0], 0, device=x.device)
                    ties = (picked.new_full((x.shape[0],), NEG_INF), idx >= 0)
                else:
                    self.indexer.detail = self.detail
                    idx, picked = self.indexer.forward(x, qr, positions, src, shared, pieces)
                    ties = self.indexer.ties
                shared.topk, shared.topk_scores = idx, picked
                shared.topk_kth, shared.topk_tied = ties
            idx = shared.topk
        source = shared.source if idx is not None and idx.shape[1] > 0 else None  # the global branch
        global_kv = source.kv_values if source is not None else None
        n_cached = keys.shape[0] - x.shape[0]
        o = self.ops.sparse_attention(self.role.layer, q, keys, n_cached, self.window_bytes, idx, source,
                                      self.w("attn.attn_sink").float(), cfg.window_size, cfg.head_dim ** -0.5)
        self.window_bytes = None
        out = run(L, "output", self.output, o, positions)
        if self.parallel is not None:  # wo_b holds this rank's input columns: a partial sum
            out = self.parallel.all_reduce(out)

        if probe is not None and self.ratio > 0 and idx is not None:
            probe["topk"] = idx
            probe["topk_scores"] = shared.topk_scores
            if shared.topk_tied is not None:
                probe["topk_kth"], probe["topk_tied"] = shared.topk_kth, shared.topk_tied
            if self.role.candidate_source or self.role.in_candidate_pool:
                probe["candidate_pool"] = shared.candidates
            probe["n_entries"] = shared.source.n_entries
            if self.detail and global_kv is not None:
                self._detail_probe(probe, q, positions, global_kv, idx)
        return out

    def _detail_probe(self, probe: dict, q, positions, global_kv, idx) -> None:
        """ProbeRequest.detail: the indexer's best unpicked entries (layers that pick) and the
        selection recall of this layer's own queries (engine/model/selection_probe.py)."""
        if self.indexer is not None and self.indexer.runners is not None:
            probe["runner_ups"], probe["runner_up_scores"] = self.indexer.runners
        visible = (positions + 1).div(self.ratio, rounding_mode="floor")
        probe["selection_recall"] = selection_recall(q.float() * self.cfg.head_dim ** -0.5, global_kv, visible, idx,
                                                     self.parallel, self.cfg.n_heads)
