"""Parity table: the engine against the official V4.1 reference code, or the GPU kernel path against
the engine's CPU `reference` numerics. One command, re-runnable whenever the checkpoint changes:

    python scripts/parity_reference.py                       # engine (CPU, reference numerics) vs official
    python scripts/parity_reference.py --numerics fp32       # the engine's fp32 numerics vs official
    python scripts/parity_reference.py --against engine-cpu --device cuda   # kernel path vs CPU (H200)

The official reference (tenstorrent/tt-metal models/demos/deepseek_v3_d_p/reference/deepseek_v41:
model.py, kernel_cpu.py, engram.py, plus stubs for its image_processor/vision imports) is NOT part of
this repository: save it as a package `deepseek_v41` under --reference-dir (default /tmp/ref). It runs
on the CPU with its own CPU kernels and bf16 as torch's default dtype, as its generate.py does, on one
torch thread (as the engine side); this
script only builds its classes, loads our checkpoint's tensors into them and listens with hooks.

Per layer: top-k Jaccard of each query's selected entries (all rows; and with rows whose only
differences are picks the engine marks tied counted as agreeing), routing agreement (share of each
token's experts both chose), mHC max |difference| of (pre, post, comb), and the logits' relative L2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.run import api  # noqa: E402
from engine import quant
from engine.roles import FULL, REINDEX, role_plan  # noqa: E402

DEFAULT_PROMPT = ROOT / "assets" / "prompts" / "04_long_incident_review.txt"


# -- one side's capture: {"topk": {L: [T, k]}, "tied": {L: [T, k] | None}, "experts": {L: [T, k]},
#    "mhc": {L: {"attn"|"ffn": {"pre", "post", "comb"}}}, "logits": [T, vocab]}

def engine_capture(checkpoint: str, ids: list[int], numerics: str, device: str, kernels, knobs: str = "") -> dict:
    """knobs: the kernel ops' tuning knobs ("name=value,...", engine/ops/knobs.py), e.g. stream_bf16=1."""
    engine = api.load(checkpoint, numerics=numerics, device=device, kernels=kernels, threads=1)
    if knobs:
        engine.model.ops.set_knobs(knobs)
    started = time.perf_counter()
    result = engine.run(ids, logits=True)
    seconds = time.perf_counter() - started
    plan = role_plan(engine.cfg)
    picking = [L for L in result.layers if plan[L].role in (FULL, REINDEX) and result.layers[L].topk is not None]
    return {"topk": {L: result.layers[L].topk for L in picking},
            "tied": {L: result.layers[L].topk_tied for L in picking},
            "experts": {L: lr.routing["experts"] for L, lr in result.layers.items()},
            "mhc": {L: lr.mhc for L, lr in result.layers.items()},
            "logits": result.logits, "seconds": seconds,
            "label": f"engine ({device}, {numerics} numerics{', kernels' if kernels else ''}"
                     f"{', ' + knobs if knobs else ''})"}


def official_capture(reference_dir: str, checkpoint: str, ids: list[int]) -> dict:
    """The official reference's classes with our checkpoint's tensors; hooks record what it computed."""
    sys.path.insert(0, reference_dir)
    try:
        from deepseek_v41 import engram as ref_engram
        from deepseek_v41 import model as ref
    except ImportError as err:
        raise SystemExit(f"error: the official reference is not under {reference_dir}/deepseek_v41 ({err}); "
                         "save model.py, kernel_cpu.py and engram.py there (see this script's docstring)")
    from safetensors import safe_open

    engine = api.load(checkpoint, numerics="fp32", threads=1)  # config and tokenizer only
    cfg = engine.cfg
    fields = set(ref.ModelArgs.__dataclass_fields__)
    args = ref.ModelArgs(**{k: getattr(cfg, k) for k in fields if hasattr(cfg, k)})
    args.max_batch_size = 1  # max_seq_len as the config says (the RoPE table's length, to the last bit)
    args.vision_n_layers, args.dspark_block_size, args.dspark_target_layer_ids = 0, 0, ()
    # the compressed vocabulary from our tokenizer (the reference builds it from a HF tokenizer object)
    ref_engram.build_compressed_token_map = lambda _tokenizer: engine.tokenizer.compressed_vocab()
    torch.set_default_dtype(torch.bfloat16)  # as the reference's generate.py
    # one thread, as the engine side: on 2 threads the reference's GEMMs split differently and it
    # disagrees with itself (measured on 200 tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = ref.Transformer(args, tokenizer=None)
        _load_official(model, Path(checkpoint), safe_open)
        capture = {"topk": {}, "tied": {}, "experts": {}, "mhc": {}}
        T = len(ids)
        for L, block in enumerate(model.layers):
            _listen(block, L, T, capture)
        head = model.head
        head.forward = lambda x, full_logits=False: ref.ParallelHead.forward(head, x, True)
        started = time.perf_counter()
        _, logits, _ = model(torch.tensor([ids]))
        capture["seconds"] = time.perf_counter() - started
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(threads)
    capture["logits"] = logits[0].float()
    capture["label"] = "official reference (CPU kernels, bf16 activations)"
    plan = role_plan(cfg)
    capture["topk"] = {L: t for L, t in capture["topk"].items() if plan[L].role in (FULL, REINDEX)}
    return capture


def _load_official(model, checkpoint: Path, safe_open) -> None:
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    handles = {}

    def read(name):
        shard = index[name]
        if shard not in handles:
            handles[shard] = safe_open(str(checkpoint / shard), "pt")
        return handles[shard].get_tensor(name)

    for name, param in model.named_parameters():
        raw = read(name)
        if param.dtype == torch.float4_e2m1fn_x2:
            value = raw.view(torch.float4_e2m1fn_x2)
        elif raw.dtype == torch.float8_e4m3fn and param.dtype not in (torch.float8_e4m3fn,):
            # stored FP8, a bf16/fp32 parameter there (wo_a): dequantized as its convert.py does
            value = quant.dequantize_fp8_weight(raw, read(name.removesuffix(".weight") + ".scale")).to(param.dtype)
        else:
            value = raw.to(param.dtype)
        if tuple(value.shape) != tuple(param.shape):
            raise SystemExit(f"error: {name}: checkpoint shape {tuple(value.shape)}, reference {tuple(param.shape)}")
        param.data = value


def _listen(block, L: int, T: int, capture: dict) -> None:
    calls = []
    mixes = block.hc_mixes

    def hc_mixes(*a, **k):
        out = mixes(*a, **k)
        calls.append(out)
        if len(calls) == 2:
            capture["mhc"][L] = {part: {"pre": c[0][0].float(), "post": c[1][0].float(), "comb": c[2][0].float()}
                                 for part, c in zip(("attn", "ffn"), calls)}
        return out
    block.hc_mixes = hc_mixes
    block.ffn.gate.register_forward_hook(lambda m, i, out: capture["experts"].__setitem__(L, out[1][:].clone()))
    if block.attn.indexer is not None:
        def on_topk(m, i, out):
            idx = out[0].long()
            capture["topk"][L] = torch.where(idx >= 0, idx - T, -1)  # the reference offsets entries past the window
        block.attn.indexer.register_forward_hook(on_topk)
        capture["tied"][L] = None


# -- the table -----------------------------------------------------------------------------------

def compare(a: dict, b: dict) -> list[dict]:
    rows = []
    for L in sorted(set(a["experts"]) & set(b["experts"])):
        row = {"layer": L}
        ea, eb = a["experts"][L], b["experts"][L]
        row["routing"] = float((ea.unsqueeze(-1) == eb.unsqueeze(-2)).any(-1).float().mean())
        if L in a["mhc"] and L in b["mhc"]:
            row["mhc_max"] = max(float((a["mhc"][L][p][k] - b["mhc"][L][p][k]).abs().max())
                                 for p in ("attn", "ffn") for k in ("pre", "post", "comb"))
        if L in a["topk"] and L in b["topk"]:
            row.update(_jaccard(a["topk"][L], b["topk"][L], a["tied"].get(L)))
        rows.append(row)
    return rows


def _jaccard(ta: torch.Tensor, tb: torch.Tensor, tied: torch.Tensor | None) -> dict:
    total, excepted, tie_rows = 0.0, 0.0, 0
    for t in range(ta.shape[0]):
        sa = set(ta[t][ta[t] >= 0].tolist())
        sb = set(tb[t][tb[t] >= 0].tolist())
        j = 1.0 if not sa | sb else len(sa & sb) / len(sa | sb)
        total += j
        if j < 1 and tied is not None and len(sa) == len(sb):
            only_a = [p for p, e in enumerate(ta[t].tolist()) if e >= 0 and e not in sb]
            if all(bool(tied[t, p]) for p in only_a):  # the differing picks were ties the engine marks
                tie_rows += 1
                j = 1.0
        excepted += j
    n = max(1, ta.shape[0])
    return {"jaccard": total / n, "jaccard_ties_excepted": excepted / n, "tie_rows": tie_rows}


def table(rows: list[dict], a: dict, b: dict) -> str:
    la, lb = a["logits"].float(), b["logits"].float()
    rel = float((la - lb).norm() / lb.norm())
    top1 = float((la.argmax(-1) == lb.argmax(-1)).float().mean())
    picked = [r for r in rows if "jaccard" in r]
    lines = [f"A: {a['label']} ({a['seconds']:.1f} s)  vs  B: {b['label']} ({b['seconds']:.1f} s)", "",
             "| layer | top-k Jaccard | ties excepted | tie rows | routing agreement | mHC max diff |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        j = (f"{r['jaccard']:.4f} | {r['jaccard_ties_excepted']:.4f} | {r['tie_rows']}" if "jaccard" in r
             else "- | - | -")
        lines.append(f"| {r['layer']} | {j} | {r['routing']:.4f} | {r.get('mhc_max', float('nan')):.2e} |")
    mean = lambda key, rs: sum(r[key] for r in rs) / max(1, len(rs))  # noqa: E731
    lines += ["",
              f"routing agreement: mean {mean('routing', rows):.4f}, worst {min(r['routing'] for r in rows):.4f}",
              (f"top-k Jaccard: mean {mean('jaccard', picked):.4f} (worst {min(r['jaccard'] for r in picked):.4f}); "
               f"ties excepted {mean('jaccard_ties_excepted', picked):.4f} "
               f"(worst {min(r['jaccard_ties_excepted'] for r in picked):.4f}); "
               f"{sum(r['tie_rows'] for r in picked)} rows differ only in tied picks") if picked else "",
              f"logits: relative L2 {rel:.2e}, top-1 agreement {top1:.4f}",
              "goal: routing >= 0.995, top-k Jaccard >= 0.98 (ties excepted), logits rel L2 <= 5e-3"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(api.DEFAULT_CHECKPOINT))
    p.add_argument("--prompt-file", default=str(DEFAULT_PROMPT))
    p.add_argument("--tokens", type=int, default=200, help="prompt tokens (BOS included)")
    p.add_argument("--numerics", default="reference", choices=("reference", "fp32"), help="the engine side's")
    p.add_argument("--device", default="cpu", help="the engine side's device (cuda: the kernel path)")
    p.add_argument("--against", default="official", choices=("official", "engine-cpu"),
                   help="B side: the official reference code, or the engine's CPU reference numerics")
    p.add_argument("--reference-dir", default="/tmp/ref", help="folder holding the package deepseek_v41")
    p.add_argument("--ops", default="", help="the kernel ops' knobs on the engine side, e.g. stream_bf16=1")
    p.add_argument("--out", help="also write the table (markdown) here")
    p.add_argument("--json", dest="json_out", help="also write the per-layer rows as JSON here")
    args = p.parse_args(argv)
    if args.ops and not args.device.startswith("cuda"):  # before any checkpoint is read
        p.error("--ops: knobs of the kernel ops, which run only with --device cuda")
    text = Path(args.prompt_file).read_text()
    tok = api.load(args.checkpoint, threads=1).tokenizer
    ids = tok.encode(text, add_bos=True)[: args.tokens]
    if len(ids) < args.tokens:
        print(f"note: the prompt has only {len(ids)} tokens", file=sys.stderr)
    kernels = True if args.device.startswith("cuda") else False
    a = engine_capture(args.checkpoint, ids, args.numerics, args.device, kernels, args.ops)
    b = (official_capture(args.reference_dir, args.checkpoint, ids) if args.against == "official"
         else engine_capture(args.checkpoint, ids, "reference", "cpu", False))
    rows = compare(a, b)
    out = table(rows, a, b)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
