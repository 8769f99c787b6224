"""The engine's kernel path: the model's hot spots run on `kernels.dispatch` over the stored bytes.

Which path (`Model.kernels`, also `engine.api.load(..., kernels=)`):
- None (auto): the kernels when the device is CUDA, triton imports, the weights come from a
  checkpoint (the kernels read its raw E4M3 / packed FP4 bytes and scales) and the model runs in one
  process; the PyTorch reference path otherwise. Training (TensorWeights of nn.Parameters) therefore
  keeps the differentiable reference path, on CUDA too.
- True: the kernel path wherever it can run (a checkpoint is still needed). On CUDA `kernels.dispatch`
  picks Triton; on the CPU the Triton versions run under TRITON_INTERPRET=1 (set before triton is
  imported), else the kernels' own references (float64 on the packed formats).
- False: never.

What the kernel path runs (hooks in engine/model.py, attention.py, moe.py; everything else stays the
reference): the FP8 block-scaled linears (`fp8_linear`, E4M3 weights + E8M0 32x32 scales), the
indexer (`quantize_fp4` of the queries, `indexer_scores` against the packed FP4 index keys,
`topk_positions`), sparse attention (`sparse_attn` over the FP8 window bytes and the selected packed
FP4 global entries), the FP4 routed experts (`moe_fp4`, raw packed weights), and the fused mHC (`mhc`:
the attention mixes; the FFN mixes fused with the attention's post/comb update). Numerics differ from
the reference where the kernels' design does: q and the MoE activations in bf16 (the reference keeps
fp32 and rounds the experts' hidden activation to FP8), bf16 outputs of attention and the linears.

`layer_parity(engine, prompt, layer)` runs the prompt, captures the layer's real kernel inputs and
compares each kernel with its reference (`kernels.dispatch.compare`), one row per kernel and case,
with a verdict against BOUNDS. `path_parity(engine, ids)` runs a whole prompt both ways.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

# rel L2 (||kernel - ref|| / ||ref||) bounds for a row's verdict, from the METHOD page of the device
# notes: float32 arithmetic lands far under 1e-3 (indexer scores: exact FP4 products, fp32 sums; mHC:
# tf32x3 dots), bf16 operands between 1e-3 and 1e-2 (attention, the FP8 linears' bf16 output, the
# MoE's bf16 activations); NaN never passes. The quantizer must be bit-exact, the top-k must pick the
# same entries up to near-ties (see _topk_verdict).
BOUNDS = {"fp8_linear": 1e-2, "sparse_attn": 1e-2, "moe_fp4": 1e-2, "mhc": 1e-3, "indexer_scores": 1e-3,
          "quantize_fp4": 0.0, "indexer_topk": 0.0}
MIN_DOT_ROWS = 16  # tl.dot needs >= 16 rows: fewer heads are zero-padded for attention and the indexer


class KernelPathError(ValueError):
    """The kernel path cannot run here; the message says why."""


# -- where the kernels can run -------------------------------------------------------------------

def interpreter_active() -> bool:
    """True when the kernels were (or will be) built for TRITON_INTERPRET=1."""
    mod = sys.modules.get("kernels.sparse_attn")
    if mod is not None:
        return type(mod._sparse_attn_kernel).__name__ == "InterpretedFunction"
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def enable_interpreter() -> bool:
    """Make the Triton kernels run on the CPU (TRITON_INTERPRET=1). Possible only before the kernels
    are imported in this process; returns whether the interpreter is (now) on."""
    if "kernels.sparse_attn" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreter_active()


def triton_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def checkpoint_backed(weights) -> bool:
    """Weights whose raw stored bytes can be read (CheckpointWeights, DeviceWeights over one)."""
    return getattr(weights, "reader", None) is not None


def decide(flag: bool | None, weights, device, parallel=None) -> bool:
    """Whether a forward on `device` takes the kernel path (see the module docstring)."""
    device = torch.device(device)
    if flag is False:
        return False
    if flag is None:
        return device.type == "cuda" and parallel is None and checkpoint_backed(weights) and triton_importable()
    if parallel is not None:
        raise KernelPathError("the kernel path runs in one process; this model is one rank of several")
    if not checkpoint_backed(weights):
        raise KernelPathError("the kernel path reads a checkpoint's stored bytes; these weights are in-memory "
                              "tensors (kernels=True needs weights from engine.api.load)")
    return True


def for_forward(model, device):
    """The KernelPath a forward of `model` on `device` uses, or None (reference path). Installed
    paths (layer_parity, tests) win; otherwise one per model and device, made on first use."""
    if model.kernel_path is not None:
        return model.kernel_path
    if model.kernels is False or (model.kernels is None and torch.device(device).type != "cuda"):
        return None  # the CPU default: decided without importing anything
    if not decide(model.kernels, model.weights, device, model.parallel):
        return None
    cached = getattr(model, "_kernel_paths", None)
    if cached is None:
        cached = model._kernel_paths = {}
    key = str(torch.device(device))
    if key not in cached:
        cached[key] = KernelPath(model.weights, device, act_quant=model.act_quant)
    return cached[key]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _e4m3_zeros(*shape, device):
    return torch.zeros(*shape, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)


# -- the kernel calls the engine's hooks make -----------------------------------------------------

class KernelPath:
    """Raw weights on the device plus one method per hook. `compute=False` only records the inputs
    of `capture_layer` (the reference path computes); each method returns None when it does not
    compute, and the caller falls back to the reference."""

    def __init__(self, weights, device, act_quant: bool = True, compute: bool = True,
                 capture_layer: int | None = None):
        if not checkpoint_backed(weights):
            raise KernelPathError("the kernel path needs a checkpoint's weights (raw stored bytes)")
        self.weights, self.reader = weights, weights.reader
        self.device = torch.device(device)
        self.act_quant, self.compute, self.capture_layer = act_quant, compute, capture_layer
        self.captured: list[tuple[str, str, tuple, dict]] = []  # (kernel, case, args, kwargs)
        self.calls: Counter = Counter()                          # kernel -> calls, for tests and benches
        self._raw: dict[str, tuple | None] = {}
        self._experts: dict[str, tuple | None] = {}

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
        """(E4M3 [N, K], E8M0 [ceil(N/32), K/32]) on the device, or None if `base` is not stored so."""
        if base not in self._raw:
            name, scale = base + ".weight", base + ".scale"
            hit = None
            if name in self.reader and scale in self.reader and self.reader.entry(name).dtype == "F8_E4M3":
                w, s = self.reader.tensor(name), self.reader.tensor(scale)
                if w.dim() == 2 and tuple(s.shape) == (-(-w.shape[0] // 32), w.shape[1] // 32) and w.shape[1] % 32 == 0:
                    hit = (w.to(self.device), s.to(self.device))
            self._raw[base] = hit
        return self._raw[base]

    def _expert_weights(self, prefix: str, n_experts: int):
        """Stacked packed FP4 experts of one layer: w1, w1_scale, w3, w3_scale, w2, w2_scale, or None."""
        if prefix not in self._experts:
            hit = None
            first = f"{prefix}experts.0.w1.weight"
            if first in self.reader and self.reader.entry(first).dtype == "I8":
                parts = []
                for w in ("w1", "w3", "w2"):
                    for leaf in ("weight", "scale"):
                        parts.append(torch.stack([self.reader.tensor(f"{prefix}experts.{e}.{w}.{leaf}")
                                                  for e in range(n_experts)]).to(self.device))
                hit = tuple(parts)
            self._experts[prefix] = hit
        return self._experts[prefix]

    # -- hooks --------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, base: str):
        """y = x W^T [.., N] for an FP8 block-scaled weight (x quantized to E4M3 per 32 as in the
        reference), or None: not an FP8 weight, activation rounding off, or not this path's layer."""
        parts = base.split(".")
        layer = int(parts[1]) if parts[0] == "layers" else None
        if not self.act_quant or not self.active(layer):
            return None
        raw = self._fp8_weight(base)
        if raw is None:
            return None
        x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
        args = (x2, *raw)
        self._record(layer, "fp8_linear", ".".join(parts[2:]), args)
        if not self.compute:
            return None
        return self._kernel("fp8_linear")(*args).float().view(*x.shape[:-1], -1)

    def sparse_attn(self, layer: int, q, window_bytes, n_cached: int, window: int, idx, packed_kv, sink):
        """Attention of q [T, H, D] (rotated, fp32) over its window (FP8 bytes of the cached + new keys,
        [n_cached + T, D] and [.., D/32]) and the selected global entries (idx [T, k] into packed_kv =
        (int8 [N, D/2], e4m3 [N, D/16]), or None) with sinks [H] -> [T, H, D] fp32, or None."""
        t, h, d = q.shape
        dev = q.device
        win_q, win_s = window_bytes
        rows = torch.arange(t, device=dev)[:, None]
        win_idx = n_cached + rows - (window - 1) + torch.arange(window, device=dev)[None, :]  # [T, W] key rows
        win_idx = torch.where(win_idx >= 0, win_idx, -1).to(torch.int32)
        if idx is None or idx.shape[1] == 0:  # no global branch: one empty slot against a dummy entry
            kv_p = torch.zeros(1, d // 2, dtype=torch.int8, device=dev)
            kv_s = _e4m3_zeros(1, d // 16, device=dev)
            sel = torch.full((t, 1), -1, dtype=torch.int32, device=dev)
        else:
            kv_p, kv_s = packed_kv
            sel = idx.to(torch.int32)
        heads = max(h, MIN_DOT_ROWS)
        qb = F.pad(q.to(torch.bfloat16), (0, 0, 0, heads - h))
        sink_p = F.pad(sink.float(), (0, heads - h))
        args = (qb.contiguous(), kv_p, kv_s, sel.contiguous(), win_q, win_s, win_idx, sink_p)
        self._record(layer, "sparse_attn", "window + selected" if idx is not None else "window only", args)
        if not self.compute:
            return None
        return self._kernel("sparse_attn")(*args)[:, :h].float()

    def indexer(self, layer: int, q, head_w, packed_keys, visible, pool_mask, pool_block: int, k: int,
                query_block: int, on_scores=None):
        """Indexer top-k over packed FP4 keys (int8 [N, Di/2], e8m0 [N, Di/32]). q [T, Hi, Di] rotated
        (quantized here with the kernels' quantize_fp4), head_w [T, Hi], visible [T] entry counts,
        pool_mask bool [T, ceil(N/pool_block)] or None. on_scores(block slice, scores) is called
        before each block's top-k (the candidate source picks the pool there).
        Returns (idx long [T, k], picked [T, k], scores [T, N]) or None."""
        t, hi, di = q.shape
        heads = max(hi, MIN_DOT_ROWS)
        qf = F.pad(q.float(), (0, 0, 0, heads - hi))
        self._record(layer, "quantize_fp4", "index queries (E8M0 / 32)", (qf.contiguous(), 32, "e8m0"))
        if not self.compute and layer != self.capture_layer:
            return None
        qp, qs = self._kernel("quantize_fp4")(qf.contiguous(), 32, "e8m0") if self.compute else \
            _reference_fp4(qf, 32)
        w = F.pad(head_w.float(), (0, heads - hi)).contiguous()
        vis = visible.to(torch.int32).contiguous()
        kp2 = _pow2(k)  # the radix top-k takes a power of two; the padding slots are sliced off
        args = (qp, qs, packed_keys[0], packed_keys[1], w, vis, pool_mask)
        self._record(layer, "indexer", "pool-masked" if pool_mask is not None else "all visible", args,
                     {"pool_block": pool_block, "topk": kp2})
        if not self.compute:
            return None
        scores_fn, topk_fn = self._kernel("indexer_scores"), self._kernel("topk_positions")
        all_scores, idx, picked = [], [], []
        for a in range(0, t, query_block):
            b = slice(a, a + query_block)
            scores = scores_fn(qp[b], qs[b], packed_keys[0], packed_keys[1], w[b], vis[b],
                               None if pool_mask is None else pool_mask[b].contiguous(), pool_block)
            if on_scores is not None:
                on_scores(b, scores)
            sel = topk_fn(scores, kp2, vis[b])[:, :k].long()
            got = scores.gather(-1, sel.clamp_min(0)).masked_fill(sel < 0, float("-inf"))
            all_scores.append(scores)
            idx.append(sel)
            picked.append(got)
        return torch.cat(idx), torch.cat(picked), torch.cat(all_scores)

    def routed(self, layer: int, prefix: str, n_experts: int, x, experts, weights, swiglu_limit: float):
        """sum over each token's experts, from the raw packed FP4 weights: x [T, dim] (the activation as
        the expert GEMM sees it), experts/weights [T, k] -> [T, dim] fp32, or None."""
        raw = self._expert_weights(prefix, n_experts)
        if raw is None:
            return None
        limit = swiglu_limit if swiglu_limit > 0 else 3e38  # the reference clamps only for a positive limit
        args = (x.to(torch.bfloat16).contiguous(), *raw, experts.to(torch.int32).contiguous(),
                weights.float().contiguous())
        self._record(layer, "moe_fp4", f"{x.shape[0]} tokens x top-{experts.shape[1]}", args,
                     {"swiglu_limit": limit})
        if not self.compute:
            return None
        return self._kernel("moe_fp4")(*args, swiglu_limit=limit).float()

    def mhc(self, layer: int, case: str, x, fn, scale, base, pre_prev, update, hc_eps, norm_eps, iters):
        """The fused mHC: [update X' = post*y + comb^T X], collapse with pre_prev, the next mixes.
        x [T, 4, dim]; update None or (y [T, dim], post [T, 4], comb [T, 4, 4]).
        Returns (X' or None, collapsed [T, dim], pre, post, comb) or None (not 4 copies, or not computing)."""
        if x.shape[1] != 4 or fn.shape[0] != 24:
            return None
        y, post_old, comb_old = update if update is not None else (None, None, None)
        args = (x.contiguous(), fn.float(), scale.float(), base.float(), pre_prev.float().contiguous(),
                None if y is None else y.float().contiguous(), post_old, comb_old)
        kwargs = {"norm_eps": norm_eps, "hc_eps": hc_eps, "iters": iters}
        self._record(layer, "mhc", case, args, kwargs)
        if not self.compute:
            return None
        return self._kernel("mhc")(*args, **kwargs)


def _reference_fp4(x, block):
    from engine import quant
    return quant.quantize_fp4(x, block, "e8m0")


# -- parity ---------------------------------------------------------------------------------------

# which positional arguments of each kernel have a leading token / query dimension
_ROW_ARGS = {"fp8_linear": (0,), "sparse_attn": (0, 3, 6), "indexer": (0, 1, 4, 5, 6), "moe_fp4": (0, 7, 8),
             "mhc": (0, 4, 5, 6, 7), "quantize_fp4": (0,)}


def _take_rows(kernel: str, args: tuple, max_rows: int | None):
    n = args[0].shape[0]
    if max_rows is None or n <= max_rows:
        return args, ""
    keep = slice(n - max_rows, n)  # the last queries: the longest contexts
    out = tuple(a[keep] if i in _ROW_ARGS[kernel] and isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
    return out, f" (rows {n - max_rows}-{n - 1} of {n})"


def _row(kernel, case, res, ok, note=""):
    return {"kernel": kernel, "case": case + note, "max_abs": res["max_abs"], "max_rel": res["max_rel"],
            "rel_l2": res["rel_l2"], "mismatched": res.get("mismatched_bytes", 0), "bound": BOUNDS.get(kernel),
            "ok": bool(ok)}


def _topk_verdict(args, kwargs, scores_res) -> tuple[dict, bool]:
    """The reference's and the kernel's top-k agree, or differ only between entries whose reference
    scores lie within twice the scores' measured difference (near-ties the rounding may flip)."""
    from kernels import dispatch
    reference, triton_version = dispatch._PAIRS["indexer_topk"]
    want, got = reference(*args, **kwargs).cpu(), triton_version(*args, **kwargs).cpu()
    scores = dispatch._PAIRS["indexer_scores"][0](*args, pool_block=kwargs["pool_block"]).double().cpu()
    slack = 2 * scores_res["max_abs"] + 1e-12
    bad_rows = differing = 0
    for r in range(want.shape[0]):
        a, b = want[r][want[r] >= 0].long(), got[r][got[r] >= 0].long()
        if torch.equal(a, b):
            continue
        differing += 1
        sa, sb = scores[r, a].sort().values, scores[r, b].sort().values
        if a.numel() != b.numel() or (sa - sb).abs().max().item() > slack:
            bad_rows += 1
    res = {"max_abs": float(differing), "max_rel": differing / max(1, want.shape[0]), "rel_l2": 0.0,
           "mismatched_bytes": int((want != got).sum())}
    return res, bad_rows == 0


def compare_captured(captured, max_rows: int | None = None) -> list[dict]:
    """Reference vs Triton on each captured call: rows {kernel, case, max_abs, max_rel, rel_l2, ok, ...}.
    For indexer top-k, max_abs counts query rows whose picks differ and max_rel their share."""
    from kernels import dispatch
    rows = []
    for kernel, case, args, kwargs in captured:
        args, note = _take_rows(kernel, args, max_rows)
        if kernel == "indexer":
            res = dispatch.compare("indexer_scores", *args, pool_block=kwargs["pool_block"])
            rows.append(_row("indexer_scores", case, res, res["rel_l2"] <= BOUNDS["indexer_scores"], note))
            tk, ok = _topk_verdict(args, kwargs, res)
            rows.append(_row("indexer_topk", f"top-{kwargs['topk']}, {case}", tk, ok, note))
            continue
        res = dispatch.compare(kernel, *args, **kwargs)
        if kernel == "quantize_fp4":
            ok = res["mismatched_bytes"] == 0
        else:
            ok = math.isfinite(res["rel_l2"]) and res["rel_l2"] <= BOUNDS[kernel]
        rows.append(_row(kernel, case, res, ok, note))
    return rows


def interpreter_cost(engine, n_tokens: int, max_rows: int) -> float:
    """A rough size of one layer's parity check under the interpreter (multiply-adds over the
    sampled rows, including the kernels' padding); the app runs it on the CPU only below a limit."""
    cfg = engine.cfg
    rows = min(n_tokens, max_rows)
    heads = max(cfg.n_heads, MIN_DOT_ROWS)
    attn = rows * heads * cfg.head_dim * (cfg.window_size + min(cfg.index_topk, n_tokens)) * 2
    index = rows * max(cfg.index_n_heads, MIN_DOT_ROWS) * cfg.index_head_dim * n_tokens
    moe = rows * cfg.n_activated_experts * 3 * cfg.dim * cfg.moe_inter_dim
    lin = rows * cfg.dim * (cfg.q_lora_rank + cfg.n_heads * cfg.head_dim + cfg.head_dim) * 2
    hc = rows * 4 * cfg.dim * 24 * 2
    return float(attn + index + moe + lin + hc)


INTERPRETER_LIMIT = 2e9  # multiply-adds; the small model with 16 rows of a 2K prompt is ~0.2e9


def layer_parity(engine, prompt, layer: int, max_rows: int | None = None) -> list[dict]:
    """Run `prompt` (text or ids), capture `layer`'s real kernel inputs, and compare each kernel
    with its reference. On CUDA the run itself takes the path the engine would take (kernels on
    auto); elsewhere the reference path runs and the Triton versions need the interpreter.
    max_rows: compare only the last `max_rows` queries/tokens of each call (None: all)."""
    from .api import EngineError, one_thread
    from kernels import dispatch  # noqa: F401  (imports triton: after the interpreter decision)

    model = engine.model
    ids = engine.encode(prompt)
    engine.check_layers([layer])
    device = torch.device(engine.device)
    if device.type != "cuda" and not interpreter_active():
        raise KernelPathError("the Triton kernels need CUDA here (TRITON_INTERPRET=1 was not set before "
                              "triton was imported, so the interpreter cannot run them)")
    if not checkpoint_backed(model.weights):
        raise EngineError("kernel parity needs a checkpoint's weights (the kernels read the stored bytes)")
    compute = decide(model.kernels, model.weights, device, model.parallel)
    kp = for_forward(model, device) if compute else None
    capture = KernelPath(model.weights, device, act_quant=model.act_quant, compute=compute, capture_layer=layer)
    if kp is not None:  # reuse the raw weights already on the device
        capture._raw, capture._experts = kp._raw, kp._experts
    with engine.lock, one_thread(), torch.inference_mode():
        before = model.kernel_path
        model.kernel_path = capture
        try:
            model.reset()
            model.forward(torch.tensor(ids, device=device))
        finally:
            model.kernel_path = before
            model.reset()
        return compare_captured(capture.captured, max_rows)


def path_parity(engine, ids: list[int], layers=None) -> dict:
    """Run `ids` on the kernel path and on the reference path (same device): logits difference,
    top-k agreement per layer, and wall time of each (the second run of each path, warmed up)."""
    from .api import one_thread
    from .model import ProbeRequest

    model = engine.model
    device = torch.device(engine.device)
    x = torch.tensor(ids, device=device)
    out = {}
    before = model.kernels
    try:
        for name, flag in (("kernels", True), ("reference", False)):
            model.kernels = flag
            times = []
            for _ in range(2):
                collect: dict = {}
                with one_thread(), torch.inference_mode():
                    model.reset()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    logits = model.forward(x, probes=ProbeRequest(layers=layers, kinds={"topk"}), collect=collect)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
            out[name] = {"logits": logits.float().cpu(), "time_s": times[-1], "first_time_s": times[0],
                         "topk": {L: p["topk"].cpu() for L, p in collect.items() if "topk" in p}}
    finally:
        model.kernels = before
        model.reset()
    a, b = out["kernels"]["logits"], out["reference"]["logits"]
    same = {L: float((out["kernels"]["topk"][L] == out["reference"]["topk"][L]).all(-1).float().mean())
            for L in out["reference"]["topk"]}
    return {"logits_max_abs": (a - b).abs().max().item(), "logits_rel_l2": ((a - b).norm() / b.norm()).item(),
            "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "topk_rows_identical": same, "time_kernels_s": out["kernels"]["time_s"],
            "time_reference_s": out["reference"]["time_s"],
            "first_time_kernels_s": out["kernels"]["first_time_s"],
            "first_time_reference_s": out["reference"]["first_time_s"]}


# -- command line (the H200 bench) ----------------------------------------------------------------

def _fmt(v):
    return f"{v:.2e}" if isinstance(v, float) else str(v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.kernel_path",
                                description="Kernel path vs reference path: whole-prompt parity and per-layer kernel parity.")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the shipped small model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=1000, help="prompt length (ids drawn from the tokenizer's text)")
    p.add_argument("--layers", type=int, nargs="*", default=[2, 20, 24])
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--out", default=None, help="write the markdown table here")
    a = p.parse_args(argv)
    if torch.device(a.device).type == "cpu":
        enable_interpreter()
    from .api import load
    engine = load(a.checkpoint, device=a.device, kernels=None)
    ids = _prompt_ids(engine, a.tokens)
    lines = [f"# Engine kernel path vs reference, {_device_name(a.device)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", f"torch {torch.__version__}, triton {_triton_version()}; checkpoint {engine.source}; "
             f"prompt {len(ids)} tokens. Produced by `python -m engine.kernel_path` (engine/kernel_path.py).", ""]
    def flush():
        text = "\n".join(lines) + "\n"
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(text)
        return text

    try:  # each section on its own: a failure is written into the table, the rest still runs
        pp = path_parity(engine, ids)
        lines += ["## Whole prompt, both paths (same device)", "",
                  "| quantity | value |", "|---|---|",
                  f"| logits max abs diff | {pp['logits_max_abs']:.3e} |",
                  f"| logits rel L2 | {pp['logits_rel_l2']:.3e} |",
                  f"| next-token argmax agreement | {pp['argmax_agree']:.4f} |",
                  f"| time, kernel path (2nd run) | {pp['time_kernels_s'] * 1e3:.1f} ms (1st: {pp['first_time_kernels_s'] * 1e3:.0f} ms, compiles) |",
                  f"| time, reference path (2nd run) | {pp['time_reference_s'] * 1e3:.1f} ms (1st: {pp['first_time_reference_s'] * 1e3:.0f} ms) |",
                  "", "Top-k selections: share of query rows whose picks are identical on both paths:", "",
                  "| layer | identical rows |", "|---|---|"]
        sources = set(engine.cfg.index_source_layers)  # Reuse layers repeat their source's picks
        lines += [f"| {L} | {v:.4f} |" for L, v in sorted(pp["topk_rows_identical"].items()) if L in sources]
    except Exception as err:  # noqa: BLE001 (a bench: report and go on)
        lines += ["## Whole prompt, both paths", "", f"FAILED: {type(err).__name__}: {err}"]
    print(flush(), flush=True)
    for layer in a.layers:
        start = time.perf_counter()
        try:
            rows = layer_parity(engine, ids, layer, a.max_rows)
        except Exception as err:  # noqa: BLE001
            lines += ["", f"## Layer {layer} kernel parity", "", f"FAILED: {type(err).__name__}: {err}"]
            continue
        lines += ["", f"## Layer {layer} kernel parity (reference vs Triton on the layer's captured inputs, "
                      f"{time.perf_counter() - start:.1f} s)", "",
                  "| kernel | case | max abs diff | max rel diff | rel L2 | bound | verdict |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['kernel']} | {r['case']} | {_fmt(r['max_abs'])} | {_fmt(r['max_rel'])} | {_fmt(r['rel_l2'])} | "
                  f"{_fmt(r['bound'])} | {'ok' if r['ok'] else 'OVER'} |" for r in rows]
        print("\n".join(lines[-len(rows) - 4:]), flush=True)
        flush()
    lines += ["", "Indexer top-k rows: max abs = query rows whose picks differ, max rel = their share; ok = none, "
              "or only near-ties (reference scores within twice the scores' measured difference). Bounds: rel L2, "
              "from the device METHOD page (fp32 arithmetic < 1e-3, bf16 operands 1e-3..1e-2)."]
    flush()
    return 0


def _prompt_ids(engine, n: int) -> list[int]:
    text = Path(__file__).read_text()[: 8 * n]  # any long text; the tokenizer covers it
    ids = engine.tokenizer.encode(text, add_bos=True) if engine.tokenizer is not None else list(range(5, 5 + n))
    while len(ids) < n:
        ids = ids + ids[1:]
    return ids[:n]


def _device_name(device) -> str:
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return "CPU (Triton interpreter)" if interpreter_active() else "CPU (the kernels' references)"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
