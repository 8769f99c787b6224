"""The V4.1-Flash forward for training: B sequences at once, static shapes, no host syncs.

Same function as the engine's `Model.forward` on a fresh run (tests/test_train_batched.py checks
logits, picks and routing against it), written for throughput instead of probes and caches:

- every op runs on [B, T, ...] at once (the engine runs one sequence, query block by query block);
- routed experts are computed densely (all E experts for every token, weighted by the routing
  weights, 0 for experts not chosen): the same sum, with static shapes and no per-expert launches;
- the sliding window is attended chunk by chunk (chunks of W queries against their own and the
  previous chunk's keys), so no [T, W, D] window copy is made;
- the global branch reads each token's selected entries in place with `fused_picks` (Triton,
  kernels/sparse_attn_train.py: the trainer's default on CUDA), or gathers them ([B, T, k, D]); in the
  dense warm-up it attends every visible entry through a mask instead;
- the caches' number formats (FP8 window, FP4 global KV and index keys, FP4 indexer queries) are
  applied with straight-through gradients, as the engine's `ste` does;
- the pure pieces (number formats, the functions compiled as one unit each, the extra losses) are in
  parts.py.

The indexer follows the V3.2 recipe: its inputs are detached, so it learns only from its KL to the
attention of the layers that use its picks (plus a small margin term that keeps selected entries'
scores off the ReLU floor), and never pushes the backbone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import quant
from ..model.attention import rms_norm, topk_in_position_order
from ..config import ModelConfig
from ..model.engram import EngramLayout, engram_forward
from ..checkpoint.layout import tensor_specs
from ..model.moe import route
from ..roles import FULL, REINDEX, LayerRole, role_plan
from ..model.rope import layer_freqs
from .parts import (NEG_INF, attn_inputs, attn_output, candidate_pool, collapse_norm, compiled, engram_rows_batched,
                    expand, experts_core, focus_loss, fp4_values, fp8_values, index_scores, mix_collapse,
                    picked_ops, rotate_bt, routing_stats, ste)

# -- the forward ------------------------------------------------------------------------------------

@dataclass
class StepOptions:
    dense: bool = False          # the warm-up: every global layer attends every visible entry
    fake_quant: bool = False     # FP8 dense linears, FP4 experts, FP8 Engram rows (straight-through)
    margin: float = 0.0          # weight of the indexer's keep-off-the-floor term
    focus: bool = False          # dense steps: the attention's own share on the indexer's top-k (loss_focus)
    analysis: bool = False       # also measure selection recall and zero-score picks (no grad)
    position_ties: bool = False  # ties at the k-th score go to the lower position, as in the engine
    seq_balance: bool = False    # also the sequence-wise expert-balance loss (loss_balance)


@dataclass
class StepOut:
    loss_ce: torch.Tensor
    loss_kl: torch.Tensor
    loss_margin: torch.Tensor
    loads: torch.Tensor                                  # [n_layers, E] tokens routed to each expert
    zero_picks: dict = field(default_factory=dict)       # index layer -> share of valid picks scoring 0
    recall: dict = field(default_factory=dict)           # index layer -> mean attention mass captured
    loss_focus: torch.Tensor | None = None               # dense steps with `focus`: mean -log(recall)
    loss_balance: torch.Tensor | None = None             # `seq_balance`: mean over layers of sequence_balance_loss
    focus_recall: dict = field(default_factory=dict)     # layer -> mean share of its global mass on the top-k
    logits: torch.Tensor | None = None
    residual_norms: list = field(default_factory=list)   # analysis: per layer [B, T, hc]
    picks: dict = field(default_factory=dict)            # analysis: index layer -> (idx, scores) [B, T, k]


class BatchedForward:
    """Runs the model over [B, T] token ids, weights from `get(name)` (float tensors, grads allowed).
    Routed experts come stacked: get('layers.L.ffn.experts.w1') -> [E, inter, dim]."""

    def __init__(self, cfg: ModelConfig, get, layout: EngramLayout | None, compressed_lookup: torch.Tensor | None,
                 bf16: bool = False, compile_parts: bool = False, checkpoint: bool = False,
                 sparse_limits: tuple[int, int] | None = None, fused_picks: bool = False):
        self.cfg, self.get, self.bf16 = cfg, get, bf16
        # (index_topk, candidate_topk_blocks) of the sparse forward: a dense forward (its config
        # lifts both limits) still picks as the sparse one would, for the focus term
        self.sparse_limits = sparse_limits or (cfg.index_topk, cfg.candidate_topk_blocks)
        # the step is launch-bound: the elementwise-heavy pure parts (mHC mixes with their 20 Sinkhorn
        # rounds, the number formats, RoPE, the attention core, the experts) can be compiled into a
        # few fused kernels each, and recomputed in the backward instead of keeping their
        # activations (`checkpoint`), which buys larger batches
        wrap = compiled if compile_parts else (lambda f: f)
        self.fp8, self.fp4, self.rotate = (wrap(f) for f in (fp8_values, fp4_values, rotate_bt))
        self.attend_core, self.experts_core = wrap(self._attend), wrap(experts_core)
        # the stream's collapse (+ RMSNorm) and expand as elementwise sums over the hc copies, not the
        # engine's batched [hc x hc] products: one fused kernel each instead of cuBLAS calls on ~1e5
        # tiny matrices (in run 5's profile those took ~0.4 s of a 1.7 s step, forward and backward)
        self.collapse_norm, self.expand = wrap(collapse_norm), wrap(expand)
        # a sub-layer's mixes and its input's collapse read the same stream X: one function, so that the
        # backward hands X one gradient instead of two to be summed (an fp32 [BT, 4, dim] add per sub-layer)
        self.mix_collapse = wrap(mix_collapse)
        self.index_scores = wrap(index_scores)
        # the attention's projections, norms, rotations and FP8 rounding on either side of its core:
        # eager, these were ~40 small kernels per layer forward and as many backward
        self.attn_inputs, self.attn_output = wrap(attn_inputs), wrap(attn_output)
        self.route, self.routing_stats = wrap(route), wrap(routing_stats)
        self.checkpoint = checkpoint
        # the picked entries read in place by Triton kernels (kernels/sparse_attn_train.py) instead of
        # gathered into [B, T, k, D] and scattered back: 1.17x the step on the H200, 20 GB less
        self.fused_picks = fused_picks
        self.named_parts = False  # profiling: name each part of the forward for the profiler
        # dense linears stored FP8 (wo_a too, though the reference multiplies it in bf16)
        self.fp8_names = frozenset(s.name for s in tensor_specs(cfg) if s.dtype == "F8_E4M3"
                                   and len(s.logical_shape) == 2 and s.kind != "engram.embed")
        self.plan: list[LayerRole] = role_plan(cfg)[: cfg.n_layers]
        self.layout, self.lookup = layout, compressed_lookup
        self.freqs = {r: layer_freqs(cfg, r) for r in set(cfg.compress_ratios[: cfg.n_layers])}
        users: dict[int, list[int]] = {}
        for role in self.plan:
            if role.index_source is not None:
                users.setdefault(role.index_source, []).append(role.layer)
        self.index_users = users  # index source -> the layers that attend its picks

    def w(self, name: str, opts: StepOptions) -> torch.Tensor:
        """A dense linear's weight as the forward sees it (FP8 fake quant in the last phase)."""
        p = self.get(name)
        if opts.fake_quant and name in self.fp8_names:
            q, s = quant.quantize_fp8_weight(p.detach(), 32)
            return ste(p, quant.dequantize_fp8_weight(q, s, 32))
        return p

    def part(self, name: str):
        """A profiler range around one part of the forward when `named_parts` is on (the profiled step)."""
        return torch.profiler.record_function("part." + name) if self.named_parts else contextlib.nullcontext()

    def matmuls(self, device: torch.device):
        """bf16 matrix products where asked (attention, MoE, head); the mHC stream, its mixes, the
        router and the losses stay in fp32 as in the reference."""
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def __call__(self, ids: torch.Tensor, opts: StepOptions) -> StepOut:
        cfg = self.cfg
        B, T = ids.shape
        dev = ids.device
        hc, dim = cfg.hc_mult, cfg.dim
        positions = torch.arange(T, device=dev)
        x = self.get("embed.weight")[ids].float()                      # [B, T, dim]
        X = x.unsqueeze(2).expand(B, T, hc, dim).reshape(B * T, hc, dim)
        pre = torch.zeros(B * T, hc, device=dev)
        pre[:, 0] = 1.0
        compressed = self.lookup[ids] if self.layout is not None else None
        shared: dict = {}
        kl_terms, margin_terms, loads, balance_terms = [], [], [], []
        out = StepOut(torch.zeros((), device=dev), torch.zeros((), device=dev), torch.zeros((), device=dev),
                      torch.zeros(0))
        shared["focus"] = []
        hc_args = (hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
        for role in self.plan:
            L = role.layer
            p = f"layers.{L}."
            if role.engram:
                with self.part("engram"):
                    X = self._engram(L, X, compressed, opts)
            with self.part("mhc.mixes_collapse"):
                a_pre, a_post, a_comb, attn_in = self._ckpt(
                    self.mix_collapse, X, self.get(p + "hc_attn_fn"), self.get(p + "hc_attn_scale"),
                    self.get(p + "hc_attn_base"), pre, self.get(p + "attn_norm.weight"), *hc_args)
            with self.matmuls(dev):
                y = self._attention(role, attn_in.view(B, T, dim), positions, shared, opts, out).float()
            with self.part("mhc.expand"):
                X1 = self.expand(y.reshape(B * T, dim), X, a_post, a_comb)
            with self.part("mhc.mixes_collapse"):
                f_pre, f_post, f_comb, ffn_in = self._ckpt(
                    self.mix_collapse, X1, self.get(p + "hc_ffn_fn"), self.get(p + "hc_ffn_scale"),
                    self.get(p + "hc_ffn_base"), a_pre, self.get(p + "ffn_norm.weight"), *hc_args)
            y, load, balance = self._moe(L, ffn_in, B, opts)
            y = y.float()
            loads.append(load)
            if balance is not None:
                balance_terms.append(balance)
            with self.part("mhc.expand"):
                X = self.expand(y, X1, f_post, f_comb)
            pre = f_pre
            if opts.analysis:
                out.residual_norms.append(X.detach().norm(dim=-1).view(B, T, hc))
            # the indexer's loss, once every layer using this source's picks has attended
            for src, users in self.index_users.items():
                if users[-1] == L and src in shared.get("index", {}):
                    with self.part("indexer.loss"):
                        kl, margin = self._indexer_losses(src, users, shared, opts, out)
                    kl_terms.append(kl)
                    margin_terms.append(margin)
        with self.part("head"):
            h = self.collapse_norm(X, pre, self.get("norm.weight"), cfg.norm_eps)
            with self.matmuls(dev):
                logits = h.view(B, T, dim) @ self.get("head.weight").t()
            out.loss_ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        if kl_terms:
            out.loss_kl = torch.stack(kl_terms).mean()
            out.loss_margin = torch.stack(margin_terms).mean()
        if balance_terms:
            out.loss_balance = torch.stack(balance_terms).mean()
        if shared["focus"]:
            out.loss_focus = torch.stack(shared["focus"]).mean()
        out.loads = torch.stack(loads)
        if opts.analysis:
            out.logits = logits.detach()
        return out

    # -- Engram -------------------------------------------------------------------------------------
    def _engram(self, L: int, X: torch.Tensor, compressed: torch.Tensor, opts: StepOptions) -> torch.Tensor:
        cfg = self.cfg
        index = self.layout.index_of(L)
        rows = engram_rows_batched(self.layout, index, compressed).flatten(0, 1)  # [BT, R]
        p = f"layers.{L}.engram."
        table = self.get(p + "embed.weight")[rows]                                  # [BT, R, hd]
        if opts.fake_quant:
            table = ste(table, self.fp8(table.detach(), 32))
        return engram_forward(X, table, self.w(p + "wkv.weight", opts), self.get(p + "q_weight"),
                              self.get(p + "k_weight"), cfg.norm_eps)

    # -- attention ----------------------------------------------------------------------------------
    def _attention(self, role: LayerRole, x: torch.Tensor, positions: torch.Tensor, shared: dict,
                   opts: StepOptions, out: StepOut) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        H = cfg.n_heads
        p = f"layers.{role.layer}.attn."
        freqs = self.freqs[role.compress_ratio]
        with self.part("attn.proj"):
            qr, q, kv = self.attn_inputs(x, self.w(p + "wq_a.weight", opts), self.get(p + "q_norm.weight"),
                                         self.w(p + "wq_b.weight", opts), self.w(p + "wkv.weight", opts),
                                         self.get(p + "kv_norm.weight"), positions, freqs, cfg.norm_eps, H)

        glob = None  # (entries [B, N, D], picks [B, T, k] or None for dense, valid [B, T, k or N])
        if role.compress_ratio > 0:
            if role.role == FULL:
                with self.part("attn.compress"):
                    shared["source"] = self._compress(role, x, freqs, opts)
            if role.role in (FULL, REINDEX):
                with self.part("attn.index"):
                    shared.setdefault("index", {})[role.layer] = self._index(role, x, qr, positions, shared, opts)
                if opts.analysis and shared["index"][role.layer]["idx"] is not None:
                    pick = shared["index"][role.layer]
                    out.picks[role.layer] = (pick["idx"], pick["scores"])
            pick = shared["index"][role.index_source]
            with self.part("attn.gather"):
                glob = (self._entries_for(role, shared, pick), pick["idx"] is None, pick["valid"])
        with self.part("attn.core"):
            o, probs_global = self._ckpt(self.attend_core, q, kv, glob, self.get(p + "attn_sink").float())
        if probs_global is not None:
            shared.setdefault("mass", {})[role.layer] = probs_global.detach().sum(2)  # [B, T, k or N]
            if "top_idx" in pick:  # a dense step with the focus term (see _index)
                with self.part("attn.focus"):
                    loss, recall = focus_loss(probs_global.sum(2), pick["top_idx"], pick["top_valid"], pick["crowded"])
                shared["focus"].append(loss)
                out.focus_recall[role.layer] = recall
        if opts.analysis and role.role in (FULL, REINDEX) and glob is not None and not glob[1]:
            with torch.no_grad():
                out.recall[role.layer] = self._recall(q, kv, shared, role, positions)
        with self.part("attn.out"):
            return self.attn_output(o, positions, freqs, self.w(p + "wo_a.weight", opts), self.w(p + "wo_b.weight", opts),
                                    cfg.o_groups, cfg.o_lora_rank)

    def _entries_for(self, role: LayerRole, shared: dict, pick: dict) -> torch.Tensor:
        """The global entries a layer attends: every entry [B, N, D] in a dense step, else the picked
        ones [B, T, k, D], gathered once for all the layers that share this KV source and top-k
        (Reuse layers: 4-6 per index source), so the gather and its backward scatter run once."""
        entries = shared["source"][0]
        if pick["idx"] is None:
            return entries
        key = (role.kv_source, role.index_source)
        gathered = shared.setdefault("gathered", {})
        if key not in gathered:
            if self.bf16:  # the attention reads them in bf16 anyway: half the bytes to gather and keep
                entries = entries.to(torch.bfloat16)
            if self.fused_picks:  # (entries [B, N, D], idx, order, starts): the kernels read the picks in place
                gathered[key] = (entries, *self._picks_in_place(pick, entries.shape[1]))
            else:
                B = entries.shape[0]
                gathered[key] = entries[torch.arange(B, device=entries.device)[:, None, None], pick["idx"]]
        return gathered[key]

    @staticmethod
    def _picks_in_place(pick: dict, n_entries: int) -> tuple:
        """(idx [B, T, k] int32 with -1 for invalid picks, order, starts): the picks as the in-place
        kernels take them, with their per-entry index for the backward; made once per pick set."""
        if "in_place" not in pick:
            with torch.no_grad():
                idx = pick["idx"].masked_fill(~pick["valid"], -1).to(torch.int32)
                pick["in_place"] = (idx, *picked_ops().pick_index(idx, n_entries))
        return pick["in_place"]

    def _compress(self, role: LayerRole, x: torch.Tensor, freqs: torch.Tensor, opts: StepOptions):
        """A Full layer's entries: (rotated FP4 KV [B, N, D], rotated FP4 index keys [B, N, Di])."""
        cfg, m = self.cfg, role.compress_ratio
        B, T, _ = x.shape
        p = f"layers.{role.layer}.attn."
        kv = x @ self.get(p + "compressor.wkv.weight").t()                          # [B, T, D]
        if m > 1:
            score = x @ self.get(p + "compressor.wgate.weight").t()
            n = T // m
            kv = kv[:, : n * m].unflatten(1, (n, m))
            weights = torch.softmax(score[:, : n * m].unflatten(1, (n, m)).float(), dim=2)
            kv = (kv * weights).sum(dim=2)
        latent = rms_norm(kv, self.get(p + "compressor.norm.weight"), cfg.norm_eps)  # [B, N, D]
        first = torch.arange(latent.shape[1], device=x.device) * m
        # the index keys learn only from the indexer's loss: their input is detached (V3.2)
        ik = rms_norm(latent.detach() @ self.get(p + "indexer.wk.weight").t(),
                      self.get(p + "indexer.k_norm.weight"), cfg.norm_eps)
        kv_entries = self.rotate(latent, first, freqs)
        ik_entries = self.rotate(ik, first, freqs)
        return (ste(kv_entries, self.fp4(kv_entries.detach(), 16, "e4m3")),
                ste(ik_entries, self.fp4(ik_entries.detach(), 32, "e8m0")))

    def _index(self, role: LayerRole, x, qr, positions, shared: dict, opts: StepOptions) -> dict:
        """Scores of every visible entry (no grad) and the picks; the inputs the losses need."""
        cfg, m = self.cfg, role.compress_ratio
        B, T, _ = x.shape
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        p = f"layers.{role.layer}.attn.indexer."
        freqs = self.freqs[m]
        qi = self.rotate((qr.detach() @ self.w(p + "wq_b.weight", opts).t()).view(B, T, hi, di), positions, freqs)
        qi = ste(qi, self.fp4(qi.detach(), 32, "e8m0"))
        head_w = (x.detach() @ self.get(p + "weights_proj.weight").t()) * (di ** -0.5 * hi ** -0.5)  # [B, T, hi]
        keys = shared["source"][1]                                                   # [B, N, Di]
        N = keys.shape[1]
        visible = (positions + 1).div(m, rounding_mode="floor")                     # [T]
        seen = torch.arange(N, device=x.device)[None, :] < visible[:, None]          # [T, N]
        with torch.no_grad():
            # one GEMM per sequence ([T*h, Di] x [Di, N]), then ReLU, head weights and mask in one pass
            scores = self.index_scores(torch.einsum("bthd,bnd->bthn", qi, keys), head_w.float(), seen)
            sparse_k, sparse_blocks = self.sparse_limits
            want_focus = opts.focus and opts.dense and sparse_k < N
            if role.candidate_source:
                shared["pool"] = candidate_pool(scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
                if want_focus:
                    shared["focus_pool"] = candidate_pool(scores, visible, sparse_blocks, cfg.candidate_block_size)
            focus_picks = {}
            if want_focus:
                # what the sparse forward would pick, for the focus term (rows that see at most k
                # entries pick them all and are left out, as in the recall probe)
                sparse_scores = scores.masked_fill(~shared["focus_pool"], NEG_INF) if role.in_candidate_pool else scores
                top, top_idx = sparse_scores.topk(sparse_k, dim=-1)
                focus_picks = {"top_idx": top_idx, "top_valid": top > NEG_INF,
                               "crowded": (sparse_scores > NEG_INF).sum(-1) > sparse_k}
            if role.in_candidate_pool:
                scores = scores.masked_fill(~shared["pool"], NEG_INF)
        k = min(cfg.index_topk, N)
        if opts.dense or k >= N:
            # every visible entry (in the pool where there is one) is a pick: attend them through a mask
            allowed = scores > NEG_INF
            return {"idx": None, "valid": allowed, "scores": scores, "qi": qi, "w": head_w, "keys": keys,
                    **focus_picks}
        if opts.position_ties:
            idx, top = topk_in_position_order(scores.flatten(0, 1), k)
            idx, top = idx.view(B, T, k), top.view(B, T, k)
            idx = idx.clamp_min(0)  # -1 slots are masked by `valid` (their score is -inf)
        else:
            top, idx = scores.topk(k, dim=-1)                                       # [B, T, k]
        return {"idx": idx, "valid": top > NEG_INF, "scores": top, "qi": qi, "w": head_w, "keys": keys,
                "all_scores": scores}

    def _ckpt(self, fn, *args):
        """fn(*args), its activations recomputed in the backward when checkpointing."""
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _attend(self, q, kv, glob, sink):
        """Softmax over each query's window and its global entries, exp(sink) in the denominator.
        q: [B, T, H, D] (scaled); kv: [B, T, D]; returns (o [B, T, H, D], probs on global or None)."""
        cfg = self.cfg
        B, T, H, D = q.shape
        W = cfg.window_size
        nC = T // W
        qc = q.view(B, nC, W, H, D)
        keys = kv.view(B, nC, W, D)
        prev = F.pad(keys, (0, 0, 0, 0, 1, 0))[:, :nC]                               # the chunk before
        kk = torch.cat([prev, keys], dim=2)                                          # [B, nC, 2W, D]
        s_win = torch.einsum("bnchd,bnkd->bnchk", qc, kk)                            # [B, nC, W, H, 2W]
        i = torch.arange(W, device=q.device)[:, None]
        j = torch.arange(2 * W, device=q.device)[None, :]
        band = (j > i) & (j <= i + W)                                                # keys t-W+1 .. t
        first = band & (j >= W)                                                      # no keys before 0
        mask = torch.cat([first[None], band[None].expand(nC - 1, -1, -1)])          # [nC, W, 2W]
        s_win = s_win.masked_fill(~mask[None, :, :, None, :], NEG_INF).flatten(1, 2)  # [B, T, H, 2W]
        parts = [s_win]
        sink = sink.view(1, 1, H, 1).expand(B, T, H, 1)
        if glob is not None and isinstance(glob[0], tuple):
            return self._attend_in_place(q, kk, s_win, sink, glob[0])
        if glob is not None:
            # every entry [B, N, D] (dense warm-up, through the mask) or the picks [B, T, k, D]
            src, dense, valid = glob
            s_glob = torch.einsum("bthd,bnd->bthn" if dense else "bthd,btkd->bthk", q, src)
            parts.append(s_glob.masked_fill(~valid[:, :, None, :], NEG_INF))
        parts.append(sink)
        logits = torch.cat(parts, dim=-1)
        probs = torch.softmax(logits.float(), dim=-1)
        p_win = probs[..., : 2 * W].view(B, nC, W, H, 2 * W)
        o = torch.einsum("bnchk,bnkd->bnchd", p_win.to(kk.dtype), kk).reshape(B, T, H, D)
        p_glob = None
        if glob is not None:
            p_glob = probs[..., 2 * W: -1]
            eq = "bthn,bnd->bthd" if dense else "bthk,btkd->bthd"
            o = o + torch.einsum(eq, p_glob.to(src.dtype), src)
        return o, p_glob

    def _attend_in_place(self, q, kk, s_win, sink, picks: tuple):
        """`_attend` with the picks read in place (kernels/sparse_attn_train.py): the window and the sink
        in one softmax here, the picks in another inside the kernel, merged through their log-sum-exps
        into the one softmax of the gathered form. Returns (o, the picks' probabilities, detached)."""
        B, T, H, D = q.shape
        nC, W = kk.shape[1], kk.shape[2] // 2
        o_glob, lse_glob, s_glob = picked_ops().picked_attention(q, *picks)
        logits = torch.cat([s_win, sink], dim=-1).float()
        lse = torch.logaddexp(torch.logsumexp(logits, dim=-1), lse_glob)                 # [B, T, H]
        p_win = torch.exp(logits[..., : 2 * W] - lse[..., None]).view(B, nC, W, H, 2 * W)
        o = torch.einsum("bnchk,bnkd->bnchd", p_win.to(kk.dtype), kk).reshape(B, T, H, D)
        o = o + (torch.exp(lse_glob - lse)[..., None] * o_glob).to(o.dtype)
        return o, torch.exp(s_glob - lse.detach()[..., None])

    def _indexer_losses(self, src: int, users: list[int], shared: dict, opts: StepOptions, out: StepOut):
        """KL(attention mass on the picks || softmax of the index scores) over rows that picked
        anything, and the margin term; also the zero-score share (and recall in analysis mode)."""
        pick = shared["index"][src]
        mass = sum(shared["mass"][u] for u in users if u in shared["mass"])          # [B, T, k or N]
        valid = pick["valid"]
        # the dot products in bf16 where the step's matmuls are (they are the KL's largest cost)
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        qi, w, keys = pick["qi"].to(dtype), pick["w"].float(), pick["keys"].to(dtype)
        if pick["idx"] is None:
            dots = torch.einsum("bthd,bnd->btnh", qi, keys)
        elif self.fused_picks:
            dots = picked_ops().picked_scores(qi, keys, *self._picks_in_place(pick, keys.shape[1])).transpose(2, 3)
        else:
            B, T, k = pick["idx"].shape
            sel_keys = keys[torch.arange(B, device=keys.device)[:, None, None], pick["idx"]]  # [B, T, k, Di]
            dots = torch.einsum("bthd,btkd->btkh", qi, sel_keys)
        score = (dots.float().relu() * w.unsqueeze(2)).sum(-1)                      # [B, T, k]
        mass = mass.float().masked_fill(~valid, 0.0)
        row_sum = mass.sum(-1, keepdim=True)
        rows = (row_sum.squeeze(-1) > 0).float()
        target = mass / row_sum.clamp_min(1e-30)
        logp = F.log_softmax(score.float().masked_fill(~valid, NEG_INF), dim=-1)
        kl = (target * (target.clamp_min(1e-30).log() - logp.clamp_min(-1e30))).masked_fill(~valid, 0.0).sum(-1)
        kl = (kl * rows).sum() / rows.sum().clamp_min(1.0)
        # a pick whose every head is at or under the ReLU floor scores exactly 0 (a tie decided by
        # position, not by the indexer): push the best head's dot product above a small margin
        best = dots.float().amax(-1)                                                 # [B, T, k]
        margin = (F.relu(0.1 - best) * valid).sum() / valid.sum().clamp_min(1)
        with torch.no_grad():
            picked_zero = ((score == 0) & valid).sum() / valid.sum().clamp_min(1)
            out.zero_picks[src] = picked_zero
        return kl, margin

    def _recall(self, q, kv, shared: dict, role: LayerRole, positions: torch.Tensor) -> dict:
        """Selection recall of an index layer: the share of the global attention mass (summed over
        heads) that this layer's picks would capture if it attended to every visible entry, and the
        same for a "most recent k entries" rule. Means over queries that see more than k entries."""
        cfg = self.cfg
        entries = shared["source"][0]
        N = entries.shape[1]
        visible = (positions + 1).div(role.compress_ratio, rounding_mode="floor")
        seen = torch.arange(N, device=q.device)[None, :] < visible[:, None]         # [T, N]
        dense = torch.ones_like(seen)[None].expand(q.shape[0], -1, -1)
        o_unused, probs = self._attend(q, kv, (entries, True, dense & seen[None]), self.get(
            f"layers.{role.layer}.attn.attn_sink").float())
        mass = probs.float().sum(2)                                                 # [B, T, N]
        total = mass.sum(-1)
        pick = shared["index"][role.layer]
        on_picks = mass.gather(-1, pick["idx"]).masked_fill(~pick["valid"], 0.0).sum(-1)
        k = pick["idx"].shape[-1]
        recent = seen & (torch.arange(N, device=q.device)[None, :] >= (visible - k)[:, None])
        on_recent = (mass * recent[None]).sum(-1)
        rows = (visible > k)[None].expand_as(total) & (total > 0)
        share = lambda part: (part / total.clamp_min(1e-30))[rows].mean() if bool(rows.any()) else torch.tensor(float("nan"))
        return {"recall": share(on_picks), "recent_k": share(on_recent), "queries": int(rows.sum())}

    # -- MoE ------------------------------------------------------------------------------------------
    def _moe(self, L: int, x: torch.Tensor, B: int, opts: StepOptions):
        """x [BT, dim] -> (y [BT, dim], load [E], balance loss or None). Every expert runs on every
        token; tokens that did not choose an expert weight it 0, so the sum equals the sparse one."""
        cfg = self.cfg
        p = f"layers.{L}.ffn."
        n_routed, n_active = cfg.experts_of(L)
        with self.part("moe.route"):
            scores, experts, weights = self.route(x, self.get(p + "gate.weight"), self.get(p + "gate.bias"), None, None,
                                                  n_active, cfg.route_scale, cfg.score_func)
        with self.part("moe.experts"), self.matmuls(x.device):
            y = self._experts(p, x, experts, weights, n_routed, opts)
        with self.part("moe.balance"):
            load, balance = self.routing_stats(scores.view(B, -1, n_routed), experts.view(B, -1, n_active), opts.seq_balance)
        return y, load, balance

    def _experts(self, p: str, x, experts, weights, n_routed: int, opts: StepOptions) -> torch.Tensor:
        dense_w = torch.zeros(x.shape[0], n_routed, device=x.device, dtype=weights.dtype).scatter(1, experts, weights)
        s = p + "shared_experts."
        return self._ckpt(self.experts_core, x, dense_w,
                          *(self.expert(p + "experts." + part, opts) for part in ("w1", "w2", "w3")),
                          *(self.w(s + part + ".weight", opts) for part in ("w1", "w2", "w3")),
                          self.cfg.swiglu_limit)

    def expert(self, name: str, opts: StepOptions) -> torch.Tensor:
        p = self.get(name)
        return ste(p, fp4_values(p.detach(), 32, "e8m0")) if opts.fake_quant else p
