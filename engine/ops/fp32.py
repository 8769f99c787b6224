"""fp32 numerics: every activation stays float32 between ops (the engine's original arithmetic)."""

from __future__ import annotations

import torch

from .. import quant
from ..model import mhc
from ..model.moe import top_experts
from ..model.rope import rotate

NEG_INF = float("-inf")
QUANTIZED = ("F8_E4M3", "I8")  # stored dtypes of the FP8 and FP4 GEMM weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last axis, in float32."""
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


class Fp32Ops:
    """The hot spots whose arithmetic depends on the numerics. `act` is where the reference rounds
    an activation to bf16; here it is the identity."""

    name = "fp32"
    # a Reindex layer's pool of fewer than index_topk visible entries: False pads the picks with -1
    # (the engine's original rule); True tops it up with visible entries outside the pool, tied at
    # -inf, as the reference's topk does (on the kernel route too: engine/model/attention.py settle)
    tops_up_pool = False
    kernels = False  # engine/ops/triton.py: True where Triton kernels compute the hot spots

    # -- the hot spots a kernel may take (engine/ops/triton.py overrides them) ------------------
    def linear(self, x: torch.Tensor, base: str, weights, act_quant: bool, round_input,
               narrow: bool = False) -> torch.Tensor:
        """y = x W^T for the weight `base.weight` of a weight source; an FP8/FP4 weight's input is
        `round_input(x)` (E4M3 with an E8M0 scale per 32, as the release's kernels quantize it). narrow: the
        caller takes y as a bf16 tensor of the same values where an op makes it so (TritonOps under the
        `reference` numerics: no widening copy); float32 here."""
        name = base + ".weight"
        w = weights.get(name)
        if act_quant and weights.stored_dtype(name) in QUANTIZED:
            return self.act(self.gemm(round_input(x), w))  # the FP8 GEMM's order of sums
        return self.act(x.float() @ w.t())  # the GEMM's output dtype (bf16 in the reference)

    def keeps_window_bytes(self, layer: int) -> bool:
        """Whether `sparse_attention` reads the window's FP8 bytes (else its float mirror)."""
        return False

    def sparse_attention(self, layer: int, q: torch.Tensor, keys: torch.Tensor, n_cached: int, window_bytes,
                         idx: torch.Tensor | None, source, sink: torch.Tensor, window: int, scale: float):
        """Attention of q [T, H, D] (rotated) over each query's window of `keys` ([n_cached + T, D], the
        cached latents then this chunk's) and, with a source, its picks idx [T, k] (-1: none) of the
        source's global entries -> out [T, H, D]. One block of queries at a time
        (engine/model/attention.py query_block)."""
        from ..model.attention import query_block
        T = q.shape[0]
        pad = max(0, window - 1 - n_cached)
        padded = torch.cat([keys.new_zeros(pad, keys.shape[1]), keys]) if pad else keys
        start = n_cached + pad - (window - 1)
        windows = padded.unfold(0, window, 1)[start:start + T]  # [T, D, W], a strided view
        global_kv = source.kv_values if source is not None else None
        rows, padding = (idx.clamp_min(0), idx < 0) if source is not None else (None, None)
        # empty slots as by position, and before a replay's first key
        key_rows = torch.arange(n_cached, n_cached + T, device=q.device)
        block = query_block(q.device)
        return torch.cat([self.attend(q[b], key_rows[b], windows[b], sink,
                                      None if source is None else (rows[b], padding[b]), global_kv, window, scale)[0]
                          for b in (slice(a, a + block) for a in range(0, T, block))])

    def index_topk(self, indexer, q: torch.Tensor, head_w: torch.Tensor, positions, src, shared):
        """The indexer's picks for rotated queries q [T, Hi, Di] and head weights [T, Hi]
        (engine/model/attention.py `Indexer.index_picks`)."""
        return indexer.index_picks(q, head_w, positions, src, shared)

    def routed_experts(self, cfg, layer: int, prefix: str, x, experts, weights, get, linear, owned=None):
        """sum_e w_e Expert_e(x) over each token's chosen experts (engine/model/moe.py routed_experts)."""
        from ..model.moe import routed_experts
        return routed_experts(cfg, prefix, x, experts, weights, get, linear, owned, act=self.act, gemm=self.gemm)

    def mhc_attention(self, layer: int, x, pre_prev, fn, scale, base, hc: int, iters: int, hc_eps: float,
                      norm_eps: float):
        """Before attention: the stream x [T, hc, dim] collapsed with the previous sub-layer's `pre`
        (the one-step lag, engine/model/mhc.py), and this sub-layer's mixes -> (input, pre, post, comb)."""
        pre, post, comb = self.hc_mixes(x, fn, scale, base, hc, iters, hc_eps, norm_eps)
        return self.collapse(x, pre_prev), pre, post, comb

    def mhc_ffn(self, layer: int, x, update, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float):
        """After attention: the stream updated by its output (update = (y, pre, post, comb) of the
        attention), collapsed for the FFN, and the FFN's mixes -> (stream, input, pre, post, comb)."""
        y, a_pre, a_post, a_comb = update
        x1 = self.expand(y, x, a_post, a_comb)
        pre, post, comb = self.hc_mixes(x1, fn, scale, base, hc, iters, hc_eps, norm_eps)
        return x1, self.collapse(x1, a_pre), pre, post, comb

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """An activation as it is stored between two ops."""
        return x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, narrow: bool = False):
        """narrow ignored (float32 out)."""
        return self.act(rms_norm(x, weight, eps))

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """The shared expert's gated product (engine/model/moe.py swiglu), stored as an activation."""
        from ..model.moe import swiglu
        return self.act(swiglu(gate, up, limit))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a + b stored as an activation (the routed experts' sum plus the shared expert's output)."""
        return self.act(a + b)

    def engram_mix(self, x, kv, q_weight, k_weight, eps: float, token_mask=None) -> torch.Tensor:
        """The Engram's gated update of the stream (engine/model/engram.py engram_mix), stored as an activation."""
        from ..model.engram import engram_mix
        return self.act(engram_mix(x, kv, q_weight, k_weight, eps, token_mask))

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False):
        """RoPE on the last len(freqs)*2 dims (engine/model/rope.py), stored as an activation."""
        return self.act(rotate(x, positions, freqs, inverse))

    def grouped_out(self, o: torch.Tensor, wo_a, name: str = "", narrow: bool = False) -> torch.Tensor:
        """The grouped output projection: o [T, g, d] x wo_a() [g, r, d] -> [T, g, r]. wo_a: the weight's
        float value on demand (ops on stored bytes do not ask); name: its stored base name. narrow: as
        `linear`'s (its consumer, wo_b's linear, takes bf16 as it is); ignored here."""
        return self.act(torch.einsum("tgd,grd->tgr", o, wo_a()))

    def break_ties(self, scores, ranking, visible, n: int, k: int, idx, picked, tied):
        """The top-k picks where a row's k-th score ties with unpicked entries. Here: as given (ties
        go to the lower positions, so a prompt run whole and token by token picks the same)."""
        return idx, picked

    def tie_marks(self, scores: torch.Tensor, idx: torch.Tensor, picked: torch.Tensor):
        """What a top-k leaves to chance (engine/model/attention.py tie_marks): (k-th score [B], tied [B, k])."""
        from ..model.attention import tie_marks
        return tie_marks(scores, idx, picked)

    def select_blocks(self, scores, visible, n_blocks: int, block: int, n: int) -> torch.Tensor:
        """The candidate source's pool (engine/model/attention.py select_candidate_blocks): ties between
        block scores go to the lower block."""
        from ..model.attention import select_candidate_blocks
        return select_candidate_blocks(scores, visible, n_blocks, block)

    def fp8_roundtrip(self, x: torch.Tensor, block: int = 32) -> torch.Tensor:
        """x as an E4M3 store (E8M0 per `block`) and load leave it (engine.quant.fp8_roundtrip), float32."""
        return quant.fp8_roundtrip(x, block)

    def quantize_fp4_with_values(self, x: torch.Tensor, block: int, scale_kind: str = "e8m0"):
        """FP4 bytes, scales and what loading them gives back (engine.quant): a source cache's entries."""
        return quant.quantize_fp4_with_values(x, block, scale_kind)

    def quantize_fp8(self, x: torch.Tensor, block: int = 32):
        """E4M3 bytes and E8M0 scales per `block` (engine.quant.quantize_fp8): a cache's stored form."""
        return quant.quantize_fp8(x, block)

    def route_topk(self, biased: torch.Tensor, k: int) -> torch.Tensor:
        """The router's choice (engine/model/moe.py top_experts)."""
        return top_experts(biased, k)

    def f32_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T in float32, a GEMM the reference runs so (a Full m > 1 layer's compressor projections)."""
        return x.float() @ w.float().t()

    def bf16_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T for a weight the reference keeps in bf16 (a bf16 GEMM there), stored as an activation."""
        return self.act(x.float() @ w.float().t())

    def gemm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w [N, K]^T for FP8/FP4 weights and FP8 activations (both dequantized), fp32."""
        return x @ w.t()

    def gemm_of(self, x: torch.Tensor, fetch, name: str) -> torch.Tensor:
        """`gemm` with the weight `name` fetched by fetch() (the kernel ops may run its stored bytes), its output
        stored as an activation."""
        return self.act(self.gemm(x, fetch().to(x.dtype)))

    # mHC: the mixes, the collapse of the copies into a sub-layer's input, the update of the stream
    def hc_mixes(self, x, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float):
        return mhc.hc_mixes(x, fn, scale, base, hc, iters, hc_eps, norm_eps)

    def collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return self.act(mhc.collapse(x, pre))

    def expand(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        return self.act(mhc.expand(y, residual, post, comb))

    def index_scores(self, q: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor) -> torch.Tensor:
        """Indexer scores sum_h w_h relu(q_h . k): q [B, H, Di], keys [N, Di], head_w [B, H] -> [B, N].
        One head at a time: [B, N], never [B, H, N]."""
        scores = None
        for h in range(q.shape[1]):  # one head at a time: [B, N], never [B, H, N]
            per_head = torch.mm(q[:, h], keys.t()).relu_()
            w = head_w[:, h:h + 1]
            scores = per_head * w if scores is None else torch.addcmul(scores, per_head, w)
        return scores

    def attend(self, q: torch.Tensor, positions: torch.Tensor, windows: torch.Tensor, sink: torch.Tensor,
               idx, global_kv: torch.Tensor | None, window_size: int, scale: float, probs: bool = False):
        """Softmax over each query's window (its last W latents) and its selected global entries,
        with exp(sink) added to each head's denominator.
        q: [B, H, D] (unscaled); windows: [B, D, W] (a strided view, oldest first; slots before
        position 0 at the front); idx: (entry ids [B, k] with -1 read as 0, bool [B, k] where they
        were -1), or None without a global branch -> (out [B, H, D], with `probs` the probabilities on
        the global entries [B, H, k], else None)."""
        w = window_size
        q = q * scale
        parts = [torch.bmm(q, windows)]  # [B, H, W]
        if int(positions[0]) < w - 1:  # the first queries' windows reach before position 0
            parts[0].masked_fill_(window_slot_positions(positions, w)[:, None, :] < 0, NEG_INF)
        gathered = None
        if global_kv is not None:
            gathered = gather_entries(global_kv, idx)
            parts.append(torch.bmm(q, gathered.transpose(1, 2)).masked_fill_(idx[1][:, None, :], NEG_INF))
        parts.append(sink.view(1, -1, 1).expand(q.shape[0], -1, 1))
        p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)[..., :-1]  # sink: denominator only
        o = torch.bmm(p[..., :w], windows.transpose(1, 2))
        if gathered is None:
            return o, None
        return torch.baddbmm(o, p[..., w:], gathered), (p[..., w:] if probs else None)


def window_slot_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """The position each window slot of each query holds (oldest first): [B] -> [B, W]; < 0 is empty."""
    return positions[:, None] - (window - 1) + torch.arange(window, device=positions.device)[None, :]


def gather_entries(global_kv: torch.Tensor, idx) -> torch.Tensor:
    """The selected global entries: (rows [B, k], padding [B, k]) -> [B, k, D] (padding reads row 0)."""
    rows, _ = idx
    return global_kv.index_select(0, rows.flatten()).view(*rows.shape, -1)
