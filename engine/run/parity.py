"""Kernel ops vs the engine's own ops: per-layer kernel parity and whole-prompt path parity, with
their command line (`python -m engine.run.parity`, the H200 bench). Outside the forward's imports: the
forward runs on whatever ops the model holds (engine/ops); this module swaps them for a run.

`layer_parity(engine, prompt, layer)` runs the prompt, captures the layer's real kernel inputs
(engine/ops/triton.py, `compute=False`) and compares each kernel with its reference
(`kernels.dispatch.compare`), one row per kernel and case, with a verdict against BOUNDS.
`path_parity(engine, ids)` runs a whole prompt on the kernel ops and on the numerics' own.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from ..ops.triton import (MIN_DOT_ROWS, KernelPathError, TritonOps, checkpoint_backed,  # noqa: F401 (the app's names)
                         enable_interpreter, interpreter_active)

# rel L2 (||kernel - ref|| / ||ref||) bounds for a row's verdict, from the METHOD page of the device
# notes: float32 arithmetic lands far under 1e-3 (indexer scores: exact FP4 products, fp32 sums; mHC:
# tf32x3 dots), bf16 operands between 1e-3 and 1e-2 (attention, the FP8 linears' bf16 output, the
# MoE's bf16 activations); NaN never passes. The quantizer must be bit-exact, the top-k must pick the
# same entries up to near-ties (see _topk_verdict).
BOUNDS = {"fp8_linear": 1e-2, "sparse_attn": 1e-2, "moe_fp4": 1e-2, "mhc": 1e-3, "indexer_scores": 1e-3,
          "quantize_fp4": 0.0, "indexer_topk": 0.0}


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
    before = model.ops
    compute = before.kernels  # on the kernel ops the run computes with them; else the numerics compute
    capture = TritonOps(before.base if compute else before, model.weights, device, act_quant=model.act_quant,
                        compute=compute, capture_layer=layer)
    if compute:  # reuse the raw weights already on the device
        capture._raw, capture._experts = before._raw, before._experts
    with engine.lock, one_thread(), torch.inference_mode():
        try:
            model.use_ops(capture)
            model.forward(torch.tensor(ids, device=device))
        finally:
            model.use_ops(before)
        return compare_captured(capture.captured, max_rows)


def path_parity(engine, ids: list[int], layers=None) -> dict:
    """Run `ids` on the kernel path and on the reference path (same device): logits difference,
    top-k agreement per layer, and wall time of each (the second run of each path, warmed up)."""
    from .api import one_thread
    from .probes import ProbeRequest

    model = engine.model
    device = torch.device(engine.device)
    x = torch.tensor(ids, device=device)
    out = {}
    before = model.ops
    base = before.base if before.kernels else before
    paths = {"kernels": before if before.kernels else TritonOps(base, model.weights, device, act_quant=model.act_quant),
             "reference": base}
    try:
        for name, ops in paths.items():
            model.use_ops(ops)
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
        model.use_ops(before)
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
    p = argparse.ArgumentParser(prog="python -m engine.run.parity",
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
             f"prompt {len(ids)} tokens. Produced by `python -m engine.run.parity` (engine/run/parity.py).", ""]
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
