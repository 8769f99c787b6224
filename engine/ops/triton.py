"""Triton kernel ops: the forward's hot spots run on `kernels.dispatch` over the checkpoint's stored bytes.

`TritonOps` wraps a numerics (`reference` or `fp32`, engine/ops) and overrides the ops a kernel
computes; everything else, and every op a kernel cannot take (a weight not stored as FP8, activation
rounding off), is the wrapped numerics' own. Chosen once, when the model is built (`decide`):
- kernels None (auto): on a CUDA device, when triton imports and the weights come from a checkpoint (the
  kernels read its raw E4M3 / packed FP4 bytes and scales): in one process, or on each rank of several
  whose weights are its ShardedWeights (engine/serve/parallel.py: the rank's slices in the stored
  formats; its routed experts only, the others' slots passed to the MoE kernel as -1; the partial index
  scores all_reduced before the top-k). Training (in-memory nn.Parameters) therefore keeps the
  differentiable ops, on CUDA too.
- True: wherever it can run (a checkpoint is still needed). On CUDA `kernels.dispatch` picks Triton; on
  the CPU the Triton versions run under TRITON_INTERPRET=1 (set before triton is imported), else the
  kernels' own references (float64 on the packed formats).
- False: never.

What the kernels compute: the FP8 block-scaled linears (`fp8_linear`, E4M3 weights + E8M0 32x32
scales), the indexer (`quantize_fp4` of the queries, `indexer_scores` against the packed FP4 index
keys, `topk_positions`) and its tie marks (`tie_marks`), sparse attention (`sparse_attn` over the FP8
window bytes and the selected packed FP4 global entries), the FP4 routed experts (`moe_fp4`, raw packed
weights, the engine's hidden state), the fused mHC (`mhc`: the attention mixes; the FFN mixes fused with
the attention's post/comb update, on the float32 stream as it is) and the FFN's stream update alone
(`mhc_expand`), RMSNorm, RoPE (`rope`, in place on the rotated dims), the Engram's gated update
(`engram_mix`), the shared expert's SwiGLU and its sum with the routed experts (`swiglu`, `add`), and the
caches' and activations' FP8/FP4 stores (`quantize_fp8`, `fp8_roundtrip`, `quantize_fp4` with the loaded
values); the one-launch elementwise and row-wise ones live in engine/ops/triton_pointwise.py. Under
`reference` they return float32 holding bf16 values, as its `act` stores them, but for the sparse
attention's output: bf16 itself, for its one consumer (the output projection's RoPE in place and bf16 GEMM).
Numerics differ from the wrapped ops only where the kernels' order of sums or their MMAs do (each kernel
against its reference: the interpreter tests; the whole forward: notes/parity.md).

Weights: the raw bytes come from the weight source's own device copy where it keeps one
(engine/ops/stored.py StoredWeights: `stored`, `stacked_experts`, no fp32 copies), else from its
reader. The FP8 weights the model uses outside a linear, wo_a and the Engram's wkv, are asked for by
name (`grouped_out`, `gemm_of`), so the kernel ops run their stored bytes and never make their float
values.

`compute=False` with `capture_layer=L` only records the kernels' inputs at layer L (the wrapped ops
compute): engine/run/parity.py compares each kernel with its reference on them.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.nn.functional as F

from .. import quant as Q
from .kernel_path import (KernelPathError, checkpoint_backed, decide, enable_interpreter,  # noqa: F401 (names
                          interpreter_active, shards_stored_bytes, triton_importable)  # callers take from here)
from .knobs import TOPK_WHOLE_ROW, KernelKnobs
from .triton_pointwise import PointwiseKernels, wide

MIN_DOT_ROWS = 16  # tl.dot needs >= 16 rows: fewer heads are zero-padded for attention and the indexer


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _k_splits(kdim: int, most: int = 16, least_width: int = 256) -> int:
    """K splits for TritonOps.f32_linear: the most (a power of two, up to `most`) that divide K into slices
    of at least `least_width`."""
    s = 1
    while s < most and kdim % (2 * s) == 0 and kdim // (2 * s) >= least_width:
        s *= 2
    return s


def _e4m3_zeros(*shape, device):
    return torch.zeros(*shape, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)


def reference_fp4(x, block):
    """The engine's own FP4 quantizer (E8M0 scales), where a capture stands in for the kernel's."""
    return Q.quantize_fp4(x, block, "e8m0")


class TritonOps(KernelKnobs, PointwiseKernels):
    """A numerics (`base`) whose hot spots run as kernels: raw weights on the device plus one
    override per op the kernels take. `calls` counts kernel launches (tests, benches); `captured`
    holds (kernel, case, args, kwargs) of `capture_layer`."""

    kernels = True

    def __init__(self, base, weights, device, act_quant: bool = True, compute: bool = True,
                 capture_layer: int | None = None):
        if not checkpoint_backed(weights):
            raise KernelPathError("the kernel path needs a checkpoint's weights (raw stored bytes)")
        self.base = base
        self.weights, self.reader = weights, weights.reader
        self.device = torch.device(device)
        self.act_quant, self.compute, self.capture_layer = act_quant, compute, capture_layer
        self.kernels = compute  # a capture-only wrapper computes with the base ops
        self.captured: list[tuple[str, str, tuple, dict]] = []
        self.calls: Counter = Counter()
        self._raw: dict[str, tuple | None] = {}
        self._bf16_fits: dict[str, bool] = {}  # FP8 weight -> whether its scales suit the bf16 form
        self._fold_fits: dict[str, bool] = {}  # experts' prefix -> whether their scales suit the folded decode
        self._experts: dict[str, tuple | None] = {}
        self._bf16: dict[str, torch.Tensor | None] = {}
        self._of_weight: dict[int, tuple] = {}  # id(float weight) -> (a weak reference to it, {what: made of it})
        self._x_memo: list[tuple] = []  # (linear input, its version, its bf16 form values): the last two

    def __getattr__(self, name):  # every op the kernels do not take is the wrapped numerics'
        return getattr(self.base, name)

    def active(self, layer: int | None) -> bool:
        return self.compute or (layer is not None and layer == self.capture_layer)

    def _record(self, layer, kernel, case, args, kwargs=None):
        if layer is not None and layer == self.capture_layer:
            self.captured.append((kernel, case, args, dict(kwargs or {})))

    def _kernel(self, name: str):
        from kernels import dispatch
        self.calls[name] += 1
        if dispatch.use_triton(self.device):
            return getattr(dispatch, name)
        reference, triton_version = dispatch._PAIRS[name]
        return triton_version if interpreter_active() else reference

    # -- raw weights --------------------------------------------------------------------------
    def _fp8_weight(self, base: str):
        """(E4M3 [N, K], E8M0 [ceil(N/32), K/32]) on the device, or None if `base` is not stored so (or, on
        one rank of several, its slice does not fall on the 32 x 32 scale blocks)."""
        if base not in self._raw:
            name, scale = base + ".weight", base + ".scale"
            hit = None
            if name in self.reader and scale in self.reader and self.reader.entry(name).dtype == "F8_E4M3":
                w, s = self._stored(name), self._stored(scale)
                blocks = None if w is None or w.dim() != 2 else (-(-w.shape[0] // 32), w.shape[1] // 32)
                if s is not None and blocks is not None and tuple(s.shape) == blocks and w.shape[1] % 32 == 0:
                    hit = (w, s)
            self._raw[base] = hit
        return self._raw[base]

    def _bf16_form(self, base: str, rows: int) -> bool:
        """Whether the FP8 linear of `base` takes the kernel's bf16 tensor-core form (exact products, no
        rescale every 32 of K: 2.1x at 4096 x 5120 x 8192 on the H200): above a decode step's 64 rows, where K
        is whole 64 blocks and every scale byte is in the form's range (checked once a weight: a host sync);
        with `linear_bf16_decode`, also a decode step's wide products."""
        w, s = self._raw[base]
        if rows <= 64 and not (self.linear_bf16_decode and w.shape[1] >= 4096 and w.shape[0] >= 2048):
            return False
        if base not in self._bf16_fits:
            from kernels.fp8_linear import bf16_form_fits
            self._bf16_fits[base] = w.shape[1] % 64 == 0 and bf16_form_fits(s)
        return self._bf16_fits[base]

    def _bf16_mma(self, rows: int) -> str:
        """The bf16 form's products: the kernel's, or cuBLAS's for a prefill's rows (knob linear_cublas)."""
        return "cublas" if self.linear_cublas and rows > 64 else "bf16"

    def _stored(self, name: str) -> torch.Tensor | None:
        """A tensor in its stored dtype on the device: the weight source's own copy where it keeps one
        (engine/ops/stored.py StoredWeights; a rank's slice, engine/serve/parallel.py ShardedWeights; None
        where it has none), else read and moved here."""
        stored = getattr(self.weights, "stored", None)
        if stored is not None:
            return stored(name)
        return self.reader.tensor(name).to(self.device)

    def forget(self, prefix: str) -> None:
        """Drop the device weights of names starting with `prefix` (a bench freeing a layer)."""
        for cache in (self._raw, self._experts, self._bf16, self._bf16_fits, self._fold_fits):
            for name in [n for n in cache if n.startswith(prefix)]:
                del cache[name]

    def _expert_weights(self, prefix: str, n_experts: int, owned: tuple[int, int] | None = None):
        """Stacked packed FP4 experts of one layer: w1, w1_scale, w3, w3_scale, w2, w2_scale, or None.
        owned (expert parallel): only experts [a, b), this rank's."""
        a, b = owned if owned is not None else (0, n_experts)
        key = prefix if owned is None else f"{prefix}[{a}:{b}]"
        if key not in self._experts:
            stacked = getattr(self.weights, "stacked_experts", None)
            hit = stacked(prefix, n_experts) if stacked is not None and owned is None else None  # no copy
            first = f"{prefix}experts.{a}.w1.weight"
            if hit is None and first in self.reader and self.reader.entry(first).dtype == "I8":
                parts = []
                for w in ("w1", "w3", "w2"):
                    for leaf in ("weight", "scale"):
                        parts.append(torch.stack([self._stored(f"{prefix}experts.{e}.{w}.{leaf}")
                                                  for e in range(a, b)]))
                hit = tuple(parts)
            self._experts[key] = hit
        return self._experts[key]

    # -- the ops ------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, base: str, weights, act_quant: bool, round_input, narrow: bool = False):
        """An FP8 block-scaled weight: y = x W^T on its stored bytes (x quantized to E4M3 per 32 by the
        kernel, as in the reference); any other weight, or activation rounding off: the base op. narrow (under
        the `reference` numerics): y as the kernel's bf16 tensor, the same values (the queries of a 4K prefill:
        no 0.8 GB widening after the GEMM, and none narrowing them again for the attention)."""
        parts = base.split(".")
        layer = int(parts[1]) if parts[0] == "layers" else None
        raw = self._fp8_weight(base) if self.act_quant and self.active(layer) else None
        if raw is not None:
            x2 = x.reshape(-1, x.shape[-1])  # a bf16 x as it is: every form quantizes from its float32 widening
            x2 = (x2 if x2.dtype == torch.bfloat16 else x2.float()).contiguous()
            args = (x2, *raw)
            self._record(layer, "fp8_linear", ".".join(parts[2:]), args)
            if self.compute:
                # bf16 values stored as float32 by the kernel (as _bf16_act keeps a bf16 output), no widening copy
                form = ({"mma": self._bf16_mma(x2.shape[0]), "x_values": self._x_values(x, x2)}
                        if self._bf16_form(base, x2.shape[0]) else {})
                return self._kernel("fp8_linear")(*args, float_out=not (narrow and self._bf16_stream),
                                                  **form).view(*x.shape[:-1], -1)
        return self.base.linear(wide(x), base, weights, act_quant, round_input)

    def _x_values(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor | None:
        """The bf16 form's E4M3-rounded input values for x, made once for linears that share it (wq_a and wkv,
        the shared expert's w1 and w3, q_a into both wq_b): the last two inputs kept, matched by identity and
        version. Inference tensors keep no version, so the ops that write in place (`rotate`) drop a kept
        input themselves. None where the kernels' references run."""
        from kernels import dispatch
        if not dispatch.use_triton(x.device):
            return None
        version = None if x.is_inference() else x._version
        for seen, seen_version, values in self._x_memo:
            if seen is x and seen_version == version:
                return values
        from kernels.fp8_linear import x_values_bf16
        values = x_values_bf16(x2)
        self._x_memo = [(x, version, values)] + self._x_memo[:1]
        return values

    @property
    def _bf16_stream(self) -> bool:
        """The wrapped numerics store activations as bf16 values (`reference`), so kernels may too."""
        return getattr(self.base, "name", "") == "reference"

    def _bf16_act(self, y: torch.Tensor) -> torch.Tensor:
        """A kernel's bf16 output as a float32 activation: already what `act` stores (bf16-rounded, or
        kept as is), so without act's two rounding copies (about 20 launches of a decode step)."""
        return y.float() if y.dtype == torch.bfloat16 else self.act(y.float())

    def bf16_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The reference's bf16 GEMM (`reference` numerics: ReferenceOps.bf16_linear, the same bits) on a bf16
        copy of the float weight made once and kept while the weight lives, not at every call (a Full layer's
        compressor and indexer projections: three weight conversions a decode step)."""
        if not (self.compute and self._bf16_stream):
            return self.base.bf16_linear(x, w)
        return (x.bfloat16() @ self._of(w, "bf16 copy", torch.Tensor.bfloat16).t()).float()

    def _of(self, w: torch.Tensor, what: str, make):
        """make(w), made once while w lives and kept under `what` (a bf16 copy, whether its values are all bf16)."""
        held = self._of_weight.get(id(w))
        if held is None or held[0]() is not w:
            held = self._of_weight[id(w)] = (weakref.ref(w), {})
            weakref.finalize(w, self._of_weight.pop, id(w), None)  # what was made goes with the weight
        if what not in held[1]:
            held[1][what] = make(w)
        return held[1][what]

    def f32_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The float32 x @ w^T: at a prefill's widths on the tf32x3 kernel (knob f32_tf32x3), in one bf16 pass where
        both operands hold bf16 values (knob f32_one_pass: the same exact products); at decode widths
        (x [M <= 256, K]) as a K-split batched GEMM and a sum over the splits: cuBLAS tiles the plain GEMM into
        too few programs there (the compressor's [64, 5120] x [5120, 512]: 21 us + a 5 us split-K pass each on
        the H200, for 10 MB); float32 sums in another order."""
        m, kdim = x.shape if x.dim() == 2 else (0, 0)
        if self.compute and self.f32_tf32x3 and m > 256:  # a prefill's: the tensor-core form, if asked
            # operands of bf16 values (knob f32_one_pass): `reference` stores every activation so; a BF16-stored
            # weight's values are (checked once a weight: a host sync)
            w16 = self._of(w, "bf16 copy", torch.Tensor.bfloat16) if self.f32_one_pass and self._bf16_stream else None
            if w16 is not None and self._of(w, "bf16 values", lambda w: bool(torch.equal(w16.float(), w.float()))):
                self.calls["f32_gemm_bf16"] += 1
                return self._kernel("f32_gemm")(x, w16, precision="bf16")
            return self._kernel("f32_gemm")(x, w)
        splits = _k_splits(kdim)
        if not self.compute or not 0 < m <= 256 or splits == 1:
            return self.base.f32_linear(x, w)
        xs = x.float().view(m, splits, -1).transpose(0, 1)  # [S, M, K/S]
        ws = w.float().view(w.shape[0], splits, -1).permute(1, 2, 0)  # [S, K/S, N]
        return torch.bmm(xs, ws).sum(0)

    def gemm_of(self, x: torch.Tensor, fetch, name: str) -> torch.Tensor:
        """x @ W^T for the weight `name` (the Engram's wkv), stored as an activation: on its stored E4M3 bytes
        by `fp8_linear` (a bf16 output: what `act` stores, and fp32 numerics keep it too) when
        it is stored so (x already E4M3-rounded per 32 by the caller: re-quantized exactly), so its float
        value is never made (a 0.6 GB dequantization each decode step at release size, 0.9 ms on the
        H200); in the kernel's bf16 form where `linear` would take it (the release's wkv, 25600 x 6144, took
        5.3 ms of a 4,096-token prefill in the FP8 form, run 18c); else the base op on fetch()."""
        raw, base = None, name[: -len(".weight")]
        if self.compute and self.act_quant and x.dim() == 2 and name.endswith(".weight"):
            raw = self._fp8_weight(base)
        if raw is None or raw[0].shape[1] != x.shape[1]:
            return self.base.gemm_of(x, fetch, name)
        form = {"mma": self._bf16_mma(x.shape[0])} if self._bf16_form(base, x.shape[0]) else {}
        # under `reference` the kernel's bf16 tensor as it is: its one reader, the Engram's mix kernel, widens what
        # it loads (H100 run 31f: a 0.32 ms widening of [4096, 25600] in each Engram layer's 4K prefill)
        return self._kernel("fp8_linear")(x.float().contiguous(), *raw, float_out=not self._bf16_stream, **form)

    def grouped_out(self, o: torch.Tensor, wo_a, name: str = "", narrow: bool = False) -> torch.Tensor:
        """The grouped output projection o [T, g, d] x wo_a() [g, r, d] -> [T, g, r]. With the reference's
        numerics and wo_a stored FP8: one bf16 batched GEMM with fp32 accumulation (the
        reference's bf16 GEMM) on the weight's bf16 value, made once from the stored bytes and kept
        (the FP8 values are exact in bf16; the reference keeps wo_a in bf16 too), so wo_a() is never
        called there; else the base op. narrow: the GEMM's bf16 tensor, the same values (wo_b's linear
        takes it as it is: no 4K prefill's 0.13 ms widening, H100 run 30a)."""
        if self.compute and self._bf16_stream:
            w = self._bf16_weight(name)
            if w is not None:
                w = w.view(o.shape[1], -1, o.shape[2])
                t, g, r = o.shape[0], o.shape[1], w.shape[1]
                # written straight into [T, g, r] (cuBLAS's strided batches), so wo_b's flatten is a view
                out = torch.empty(t, g, r, dtype=torch.bfloat16, device=o.device)
                torch.bmm(o.transpose(0, 1).to(torch.bfloat16), w.transpose(1, 2), out=out.transpose(0, 1))
                return out if narrow else out.float()
        return self.base.grouped_out(o, wo_a, name)

    def _bf16_weight(self, base: str) -> torch.Tensor | None:
        """bf16 [N, K] value of the stored FP8 weight `base` (exact), kept; None if not stored so."""
        if base not in self._bf16:
            raw = self._fp8_weight(base) if base else None
            self._bf16[base] = None if raw is None else Q.dequantize_fp8_weight(*raw, 32).to(torch.bfloat16)
        return self._bf16[base]

    def keeps_window_bytes(self, layer: int) -> bool:
        return self.active(layer)

    def sparse_attention(self, layer: int, q, keys, n_cached: int, window_bytes, idx, source, sink,
                         window: int, scale: float):
        """Attention of q [T, H, D] (rotated, fp32) over its window (FP8 bytes of the cached + new keys,
        [n_cached + T, D] and [.., D/32]) and the selected global entries (idx [T, k] into the source's
        packed KV) with sinks [H] -> [T, H, D]."""
        if not self.active(layer):
            return self.base.sparse_attention(layer, q, keys, n_cached, window_bytes, idx, source, sink, window, scale)
        t, h, d = q.shape
        dev = q.device
        win_q, win_s = window_bytes
        rows = torch.arange(t, device=dev)[:, None]
        win_idx = n_cached + rows - (window - 1) + torch.arange(window, device=dev)[None, :]  # [T, W] key rows
        win_idx = torch.where(win_idx >= 0, win_idx, -1).to(torch.int32)
        if source is None:  # no global branch: nothing selected (no selected tile scored), a dummy entry's bytes
            kv_p = torch.zeros(1, d // 2, dtype=torch.int8, device=dev)
            kv_s = _e4m3_zeros(1, d // 16, device=dev)
            sel = torch.empty(t, 0, dtype=torch.int32, device=dev)
        else:
            kv_p, kv_s = source.packed()[:2]
            sel = idx.to(torch.int32)
        heads = max(h, MIN_DOT_ROWS)
        # the kernels round q to bf16 as they load it: a bf16-valued float32 q (the `reference` stream) goes as
        # it is, with no padded copy where the heads fill the MMA (the two passes take a bf16 copy of their own:
        # kernels/sparse_attn.py)
        qb = q if self._bf16_stream else q.to(torch.bfloat16)
        if heads != h:
            qb = F.pad(qb, (0, 0, 0, heads - h))
        sink_p = F.pad(sink.float(), (0, heads - h))
        args = (qb.contiguous(), kv_p, kv_s, sel.contiguous(), win_q, win_s, win_idx, sink_p)
        self._record(layer, "sparse_attn", "window + selected" if source is not None else "window only", args)
        if not self.compute:
            return self.base.sparse_attention(layer, q, keys, n_cached, window_bytes, idx, source, sink, window, scale)
        # under `reference`, bf16 as the kernel stores it: its one consumer (Attention.output: the RoPE in place,
        # then grouped_out's bf16 GEMM) takes bf16, so neither a float32 output nor a bf16 copy of it is made (a
        # 4K prefill's o: 0.27 GB written instead of 0.54, and no 0.8 GB conversion); else float32 values
        out = self._kernel("sparse_attn")(*args, float_out=not self._bf16_stream, **self._attn_launch(args))
        return out if heads == h else out[:, :h].contiguous()

    def break_ties(self, *args):
        """The wrapped numerics' choice among tied picks; with ties_branch_free, in its branch-free form."""
        if not (self.compute and self.ties_branch_free):
            return self.base.break_ties(*args)
        from ..capture import branch_free
        with branch_free():
            return self.base.break_ties(*args)

    def _attn_launch(self, args) -> dict:
        """The sparse attention kernel's launch options the knobs ask for (none where its reference runs)."""
        if not (self.attn_two_pass or self.attn_bf16x2 or self.attn_one_pass or self.attn_big_chunks
                or self.attn_wgmma):
            return {}  # the decode step's hot path: nothing imported or checked with the knobs off
        from kernels import dispatch
        if not (dispatch.use_triton(self.device) or interpreter_active()):
            return {}
        from kernels.sparse_attn import int32_offsets_reach
        q, kv_p, win_q = args[0], args[1], args[4]
        if self.attn_wgmma:  # a prefill's width first: a decode step fails it at once
            from kernels import sparse_attn_wgmma
            from kernels._formats import sm_count
            t, h, d = q.shape
            if (t * (h // 64) >= sm_count(q.device) and sparse_attn_wgmma.wgmma_fits(h, d)
                    and sparse_attn_wgmma.runs_on(q.device)):
                return {"layout": "wgmma", **self.attn_wgmma_options()}
        if self.attn_one_pass:
            return {"layout": "entries" if int32_offsets_reach(kv_p, win_q, q.shape[-1]) else "heads"}
        options = {"two_pass": {"decode": "bf16x2"}} if self.attn_bf16x2 else {}
        if self.attn_two_pass and int32_offsets_reach(kv_p, win_q, q.shape[-1]):
            options["layout"] = "two_pass"
        if self.attn_big_chunks:
            options["weight_bytes"] = 1 << 27
        return options

    def index_topk(self, indexer, q, head_w, positions, src, shared):
        """The indexer's top-k on kernels (the base op where this wrapper only records): FP4 queries by
        the kernels' quantizer against the source's packed FP4 index keys, scores and top-k by kernels,
        a block of queries at a time (`_query_rows`). The candidate source picks its pool from each
        block's kernel scores (ops.select_blocks); the top-k kernel ranks `indexer.ranking` (a short
        pool topped up from outside it), and `indexer.settle` marks the ties and lets the numerics break
        them, as on the CPU route (engine/model/attention.py Indexer)."""
        from ..model.attention import QUERY_BLOCK
        from ..model.selection_probe import runner_ups

        layer, role, cfg = indexer.role.layer, indexer.role, indexer.cfg
        if not self.active(layer):
            return self.base.index_topk(indexer, q, head_w, positions, src, shared)
        n = src.n_entries
        k = min(cfg.index_topk, n)
        visible = (positions + 1).div(indexer.ratio, rounding_mode="floor")  # entries each query may see
        block = cfg.candidate_block_size
        pool = shared.candidates[:, ::block].contiguous() if role.in_candidate_pool else None  # per block
        _, _, ik_packed, ik_scale = src.packed()
        inputs = self._index_inputs(layer, q, head_w, (ik_packed, ik_scale), visible, pool, block, k)
        if inputs is None:
            return self.base.index_topk(indexer, q, head_w, positions, src, shared)
        qp, qs, w, vis, kp2 = inputs
        scores_fn, topk_fn = self._kernel("indexer_scores"), self._kernel("topk_positions")
        rows = self._query_rows(q.device, n, QUERY_BLOCK)
        one_block = rows >= q.shape[0]  # a prefill's queries in one block: the pool is that block's, no copy
        if role.candidate_source and not one_block:
            shared.candidates = torch.zeros(q.shape[0], n, dtype=torch.bool, device=q.device)
        parts = []
        for a in range(0, q.shape[0], rows):
            b = slice(a, a + rows)
            scores = scores_fn(qp[b], qs[b], ik_packed, ik_scale, w[b], vis[b],
                               None if pool is None else pool[b].contiguous(), block)  # [B, N], -inf masked
            if indexer.parallel is not None:  # this rank's index heads: a partial sum, before any top-k
                scores = indexer.parallel.all_reduce(scores)
            if role.candidate_source:
                chosen = self.select_blocks(scores, visible[b], cfg.candidate_topk_blocks, block, n)
                if one_block:
                    shared.candidates = chosen
                else:
                    shared.candidates[b] = chosen
            # the kernel ranks what `settle` would (a short pool topped up from outside it): no re-take
            ranking = indexer.ranking(scores, visible[b])
            sel = topk_fn(ranking, kp2, vis[b], whole_row=TOPK_WHOLE_ROW if self.topk_whole_row else 0)[:, :k].long()
            got = ranking.gather(-1, sel.clamp_min(0)).masked_fill(sel < 0, float("-inf"))
            kth, tied = self.tie_marks(ranking, sel, got)
            parts.append((sel, got, kth, tied, scores, ranking if ranking.data_ptr() != scores.data_ptr() else None))
        idx, picked, kth, tied, scores = (torch.cat(p) for p in list(zip(*parts))[:5])
        own = [r for *_, r in parts if r is not None]  # blocks whose ranking is not their scores (a top-up)
        ranking = torch.cat([s if r is None else r for *_, s, r in parts]) if own else scores
        # the ties settled once for every block: one host read of the tied rows where the numerics take one,
        # after all the blocks' kernels are queued (a 4K prefill in 512-query blocks had taken 8 reads)
        idx, picked, kth, tied = indexer.resolve_ties(scores, ranking, visible, n, k, idx, picked, kth, tied)
        indexer.took(idx, (kth, tied), runner_ups(scores, idx) if indexer.detail else None,
                     scores if torch.is_grad_enabled() else None)
        return idx, picked

    SCORE_ELEMENTS = 1 << 25  # a query block's [rows, entries] scores on the GPU: 128 MB of float32

    @classmethod
    def _query_rows(cls, device: torch.device, n: int, block: int) -> int:
        """Queries scored a block: on the GPU as many as SCORE_ELEMENTS allows (a 4K prefill over ~1K entries
        in one block: ~10 launches and host steps a block, 8x fewer than 512-query blocks), in whole
        `block`s; where the kernels' references run, `block` (the CPU route's memory bound)."""
        from kernels import dispatch
        if not dispatch.use_triton(device):
            return block
        return max(1, cls.SCORE_ELEMENTS // max(n * block, 1)) * block

    def _index_inputs(self, layer: int, q, head_w, packed_keys, visible, pool_mask, pool_block: int, k: int):
        """The indexer kernels' operands: q [T, Hi, Di] rotated, quantized here by the kernels'
        quantize_fp4 (heads zero-padded to MIN_DOT_ROWS), head_w [T, Hi], visible [T] entry counts,
        pool_mask bool [T, ceil(N/pool_block)] or None; recorded for `capture_layer`.
        -> (q packed, q scales, weights, visible int32, top-k width: a power of two), or None when
        only recording."""
        t, hi, di = q.shape
        heads = max(hi, MIN_DOT_ROWS)
        # the quantizer widens bf16 queries as it loads them; no pad, no copy, at 16 heads or more (a 4K prefill's
        # zero-width pad had been a 41 us copy, H100 run 31f)
        qf = (F.pad(q, (0, 0, 0, heads - hi)) if heads > hi else q).contiguous()
        self._record(layer, "quantize_fp4", "index queries (E8M0 / 32)", (qf, 32, "e8m0"))
        qp, qs = self._kernel("quantize_fp4")(qf, 32, "e8m0") if self.compute else reference_fp4(qf, 32)
        w = F.pad(head_w.float(), (0, heads - hi)).contiguous()
        vis = visible.to(torch.int32).contiguous()
        kp2 = _pow2(k)  # the radix top-k takes a power of two; the padding slots are sliced off
        args = (qp, qs, packed_keys[0], packed_keys[1], w, vis, pool_mask)
        self._record(layer, "indexer", "pool-masked" if pool_mask is not None else "all visible", args,
                     {"pool_block": pool_block, "topk": kp2})
        if not self.compute:
            return None
        return qp, qs, w, vis, kp2

    def routed_experts(self, cfg, layer: int, prefix: str, x, experts, weights, get, linear, owned=None):
        """The routed experts from the raw packed FP4 weights: x [T, dim] (rounded for the expert GEMM by the
        kernel, as the base op's `linear(x, None)` does), experts/weights [T, k] -> [T, dim] fp32; the base op
        when not stored so."""
        n_experts = cfg.experts_of(layer)[0]
        raw = self._expert_weights(prefix, n_experts, owned) if self.active(layer) else None
        if raw is not None:
            limit = cfg.swiglu_limit if cfg.swiglu_limit > 0 else 3e38  # the reference clamps only for a positive limit
            ids = experts if owned is None else torch.where((experts >= owned[0]) & (experts < owned[1]),
                                                            experts - owned[0], -1)  # -1: another rank's
            # the kernel rounds x to the E4M3-per-32 grid itself (as linear(x, None) does), storing the grouped
            # GEMM's copy in its decoders' nibble order in the same pass (no 58 us nib_order copy at 4K tokens)
            args = (x.contiguous(), *raw, ids.to(torch.int32).contiguous(), weights.float().contiguous())
            # the wrapped numerics' hidden state (w * h in E4M3 per 32; `reference`: bf16 gate, up, w * h and
            # expert outputs), in either form
            from kernels.moe import fp8_form_pays, token_block
            fp8 = self.moe_fp8_mma and fp8_form_pays(ids.numel(), raw[0].shape[0])
            form = {"swiglu_limit": limit, "hidden": "reference" if self._bf16_stream else "fp32", "fp8_mma": fp8}
            if self.moe_fold and self._fold_ok(prefix, raw):
                form["bf16_decode"] = "fold"
            if not fp8 and token_block(ids.numel(), raw[0].shape[0]) == 64:  # a prefill's widths: the tile knobs
                if self.moe_narrow_gate_up:
                    form.update(block_n=64, maxnreg=168, down_block_n=128, down_maxnreg=0)
                if self.moe_narrow_down:
                    form["down_block_n"] = 64
                if self.moe_split_tiles:
                    form["split_m"] = 128
                    # beside narrow tiles, 128 x 64 split tiles, uncapped (the same area's spill under the cap)
                    if self.moe_narrow_gate_up or self.moe_narrow_down:
                        form.update(split_n=64, split_maxnreg=0)
                if (self.moe_ws or self.moe_rs) and form.get("bf16_decode") == "fold":
                    from kernels.moe_ws import gluon_fits, runs_on
                    if runs_on(x.device) and gluon_fits(x.shape[-1], raw[0].shape[1]):  # (dim, inter)
                        if not self.moe_rs:
                            form.update(ws=True, ws_decoders=2)
                        else:
                            form.update(ws="rs", **self.moe_rs_options())
            self._record(layer, "moe_fp4", f"{x.shape[0]} tokens x top-{experts.shape[1]}", args, form)
            if self.compute:
                return self._kernel("moe_fp4")(*args, **form).float()
        return self.base.routed_experts(cfg, layer, prefix, wide(x), experts, weights, get, linear, owned)

    def _fold_ok(self, prefix: str, raw) -> bool:
        """Whether every expert scale of `prefix` suits the folded decode (a host read, once a layer)."""
        if prefix not in self._fold_fits:
            from kernels.fp4_tiles import fold_fits
            self._fold_fits[prefix] = fold_fits(raw[1], raw[3], raw[5])
        return self._fold_fits[prefix]

    def _mhc(self, layer: int, case: str, x, fn, scale, base, pre_prev, update, hc_eps, norm_eps, iters):
        """The fused mHC: [update X' = post*y + comb^T X], collapse with pre_prev, the next mixes.
        Returns (X' or None, collapsed [T, dim], both as `act` stores them, pre, post, comb), or None (not 4
        copies, or recording)."""
        if not self.active(layer) or x.shape[1] != 4 or fn.shape[0] != 24:
            return None
        y, post_old, comb_old = update if update is not None else (None, None, None)
        # the reference's stream is bf16 (every value here bf16-exact, in float32 tensors): read as it is
        # (`bf16_values`, knob mhc_f32_stream), the kernel stores the update and the collapse rounded to bf16
        # values (as the reference does) and takes its bf16 3-piece dots instead of tf32x3 (H200 run 15a: 2 x 42
        # us a decode step in float32 dots, 25 us in the bf16 bench); no bf16 copy of the stream before it and no
        # float32 copy of its outputs after (a 4K-token prefill: ~2 GB a layer of copies, ~0.5 ms at the copy
        # rate). The knob off: the stream handed over as a bf16 copy (what runs 15-20 timed)
        f32_stream = self._bf16_stream and self.mhc_f32_stream and not self._narrow_stream
        stream = torch.bfloat16 if self._bf16_stream and not f32_stream else torch.float32
        # a narrowed y (the attention's wo_b) as it is: the kernel widens what it loads
        y = None if y is None else (y if y.dtype == torch.bfloat16 else y.to(stream)).contiguous()
        args = (x.to(stream).contiguous(), fn.float(), scale.float(), base.float(), pre_prev.float().contiguous(),
                y, post_old, comb_old)
        kwargs = {"norm_eps": norm_eps, "hc_eps": hc_eps, "iters": iters,
                  **({"bf16_values": True} if f32_stream else {})}
        self._record(layer, "mhc", case, args, kwargs)
        if not self.compute:
            return None
        x1, collapsed, *mixes = self._kernel("mhc")(*args, **kwargs)
        if not f32_stream:  # bf16 outputs (or fp32 numerics' own): as `act` stores them, the stream kept bf16
            # where knob stream_bf16 asks, and then the collapse too: its one reader is an RMSNorm, which widens
            # what it loads (H100 run 31d: two 66-us widening copies a 4K prefill)
            x1 = x1 if x1 is None or self._narrow_stream else self._bf16_act(x1)
            collapsed = collapsed if self._narrow_stream else self._bf16_act(collapsed)
        return x1, collapsed, *mixes

    def mhc_attention(self, layer: int, x, pre_prev, fn, scale, base, hc: int, iters: int, hc_eps: float,
                      norm_eps: float):
        fused = self._mhc(layer, "attention mixes", x, fn, scale, base, pre_prev, None, hc_eps, norm_eps, iters)
        if fused is None:
            return self.base.mhc_attention(layer, wide(x), pre_prev, fn, scale, base, hc, iters, hc_eps, norm_eps)
        _, attn_in, pre, post, comb = fused  # one launch: collapse + mixes, stored as `act` stores them
        return attn_in, pre, post, comb

    def expand(self, y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """The FFN's stream update (no collapse follows it in the block to fuse it with): one launch, bit for
        bit the `reference` numerics' float32 sums (kernels/mhc.py mhc_expand), where they take ~11 launches
        over the 4 copies; other numerics, or other than 4 copies: theirs."""
        if not (self.compute and self._bf16_stream) or residual.shape[1] != 4:
            return self.base.expand(wide(y), wide(residual), post, comb)
        return self._kernel("mhc_expand")(y, residual, post, comb, bf16_out=self._narrow_stream)

    def mhc_ffn(self, layer: int, x, update, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float):
        y, a_pre, a_post, a_comb = update
        fused = self._mhc(layer, "FFN mixes + attention update", x, fn, scale, base, a_pre, (y, a_post, a_comb),
                          hc_eps, norm_eps, iters)
        if fused is None:
            update = (wide(y), a_pre, a_post, a_comb)  # the wrapped numerics' float32 (y narrowed by wo_b's linear)
            return self.base.mhc_ffn(layer, wide(x), update, fn, scale, base, hc, iters, hc_eps, norm_eps)
        x1, ffn_in, pre, post, comb = fused  # the attention's post/comb update fused with the FFN's collapse + mixes
        return x1, ffn_in, pre, post, comb
