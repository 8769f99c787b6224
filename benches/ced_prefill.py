"""CED prefill against the reference's full prefill (issue 20): how much time it saves, how much it
changes.

    python benches/ced_prefill.py [--checkpoint assets/model] [--device cpu|cuda] [--tokens 1024 ...]
        [--prompts 2] [--replays 1 2 4 8] [--generate 32] [--repeat 3] [--out FILE.json] [--png FILE.png]
    python benches/ced_prefill.py --from-json FILE.json --png FILE.png   # redraw the curve only

Prompts are held-out prose and code: assets/corpus/heldout_prose.txt and heldout_code.txt when they
exist, otherwise the documents of assets/corpus/heldout_sample.txt told apart by the manifest
(pydoc/ = prose, stdlib/ = code); `--prompts` non-overlapping slices of each length per kind, each
after a BOS.

Per prompt: one full run (the decoder layers probed at the generated tokens, `--generate` greedy
tokens), then per replay R (multiples of the window) one CED run teacher-forced on the full run's
tokens (`continuation`), so every step compares the same inputs:
- the last prompt token's next-token logits: relative L2 against full, argmax agreement;
- the greedy continuation: the first step where the CED run's pick differs (= where its own greedy
  continuation would part; --generate when never);
- the decoder layers at the generated tokens: top-k Jaccard of the selections and routing agreement
  (shared routed experts / k), averaged over decoder layers and steps.
Timing: prefill seconds (no probes, no decode), full and every R interleaved in each of --repeat
rounds after the accuracy runs (which warm up the same shapes); the best round per variant. The
ratio ced/full is set against the tally's active-parameter ratio (per prompt token: encoder + layer
20's projection vs every layer; the release's 7.90 B / 16.13 B) and the same with R tokens replayed.
Works on the CPU and on a CUDA GPU (--device cuda: weights on the GPU, the Triton kernel path when
available); prints a table and writes everything to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CORPUS = ROOT / "assets" / "corpus"
KINDS = ("prose", "code")


def heldout_texts() -> tuple[dict[str, str], str]:
    """{kind: text} and where it came from."""
    split = {k: CORPUS / f"heldout_{k}.txt" for k in KINDS}
    if all(p.exists() for p in split.values()):
        return {k: p.read_text(encoding="utf-8") for k, p in split.items()}, "assets/corpus/heldout_{prose,code}.txt"
    manifest = json.loads((CORPUS / "MANIFEST.json").read_text())
    sample = (CORPUS / "heldout_sample.txt").read_text(encoding="utf-8").encode("utf-8")
    rows = sorted((r for r in manifest["documents"] if r["split"] == "heldout"),
                  key=lambda r: hashlib.sha256(r["path"].encode("utf-8")).digest())  # the sample's order
    parts: dict[str, list[str]] = {k: [] for k in KINDS}
    at = 0
    for row in rows:
        if at >= len(sample):
            break
        doc = sample[at:at + row["bytes"]]  # the last one may be cut short
        parts["prose" if row["path"].startswith("pydoc/") else "code"].append(doc.decode("utf-8", errors="ignore"))
        at += row["bytes"] + 1
    return {k: "\n".join(v) for k, v in parts.items()}, "assets/corpus/heldout_sample.txt split by MANIFEST.json"


def prompts(engine, text: str, n_tokens: int, count: int) -> list[list[int]]:
    """`count` non-overlapping slices of n_tokens - 1 tokens, evenly spread over the text, after BOS."""
    ids = engine.tokenizer.encode(text, add_bos=False)
    need = n_tokens - 1
    if len(ids) < need * count:
        raise SystemExit(f"error: the text has {len(ids)} tokens, too few for {count} prompts of {n_tokens}")
    step = (len(ids) - need) // max(1, count - 1) if count > 1 else 0
    bos = engine.tokenizer.bos_id if hasattr(engine.tokenizer, "bos_id") else 0
    return [[bos] + ids[i * step:i * step + need] for i in range(count)]


def accuracy(engine, ids: list[int], replays: list[int], generate: int, decoder: list[int]) -> dict:
    import torch

    from explorer.ced_view import first_divergence, jaccard_rows, overlap_rows
    probes = ("topk", "routing")
    full = engine.run(ids, layers=decoder, probes=probes, generate=generate, generated_probes=True, logits=True)
    last = full.logits[-1].double()
    out = {"generated": len(full.generated_ids), "by_replay": {}}
    for replay in replays:
        ced = engine.run(ids, layers=decoder, probes=probes, prefill="ced", replay=replay,
                         continuation=full.generated_ids, generated_probes=True, logits=True)
        mine = ced.logits[-1].double()
        jac, route = [], []
        for layer in decoder:
            a, b = full.generated_layers[layer], ced.generated_layers[layer]
            steps = min(a.routing["experts"].shape[0], b.routing["experts"].shape[0])
            if a.topk is not None and b.topk is not None:
                jac.append(jaccard_rows(a.topk[:steps].numpy(), b.topk[:steps].numpy()).mean())
            route.append(overlap_rows(a.routing["experts"][:steps].numpy(), b.routing["experts"][:steps].numpy()).mean())
        same = [x == y for x, y in zip(full.generated_ids, ced.generated_ids)]
        out["by_replay"][str(replay)] = {
            "logits_rel_l2": float(torch.linalg.vector_norm(mine - last) / torch.linalg.vector_norm(last)),
            "argmax_agrees": bool(int(mine.argmax()) == int(last.argmax())),
            "diverges_at": first_divergence(full.generated_ids, ced.generated_ids),
            "step_pick_agreement": sum(same) / max(1, len(same)),
            "topk_jaccard": float(sum(jac) / len(jac)) if jac else None,
            "routing_agreement": float(sum(route) / len(route)),
        }
    return out


def timing(engine, ids: list[int], replays: list[int], repeat: int) -> dict:
    """Best prefill seconds per variant over `repeat` interleaved rounds (no probes, no decode)."""
    variants = [("full", None)] + [("ced", r) for r in replays]
    seconds: dict[str, list[float]] = {}
    for _ in range(repeat):
        for prefill, replay in variants:
            result = engine.run(ids, probes=(), prefill=prefill, replay=replay)
            seconds.setdefault(prefill if replay is None else f"ced_{replay}", []).append(result.prefill_s)
    return {k: {"best_s": min(v), "all_s": v} for k, v in seconds.items()}


def param_ratios(engine, checkpoint: str) -> dict:
    from engine.config import release_config
    from engine.tally import tally_from_checkpoint, tally_from_config
    small, release = tally_from_checkpoint(checkpoint), tally_from_config(release_config())
    return {"model": {"prefill": small.active_prefill_params, "decode": small.active_decode_params,
                      "ratio": small.active_prefill_params / small.active_decode_params},
            "release": {"prefill": release.active_prefill_params, "decode": release.active_decode_params,
                        "ratio": release.active_prefill_params / release.active_decode_params}}


def expected_ratio(ratio: float, n_tokens: int, replay: int) -> float:
    """Active parameters of a CED prefill over a full one: T - R tokens at `ratio`, R tokens whole."""
    replay = min(replay, n_tokens)
    return ((n_tokens - replay) * ratio + replay) / n_tokens


def run(args) -> dict:
    import torch

    from engine.run import api
    from engine.roles import decoder_start
    engine = api.load(args.checkpoint, device=args.device, numerics=args.numerics,
                      kernels={"auto": None, "on": True, "off": False}[args.kernels])
    cfg = engine.cfg
    split = decoder_start(cfg)
    decoder = list(range(split, cfg.n_layers))
    replays = [m * cfg.window_size for m in args.replays]
    texts, source = heldout_texts()
    ratios = param_ratios(engine, args.checkpoint)
    out = {"bench": "ced_prefill", "checkpoint": args.checkpoint, "identity": engine.identity,
           "device": args.device, "device_name": torch.cuda.get_device_name(0) if args.device == "cuda"
           else platform.processor() or platform.machine(), "numerics": engine.numerics,
           "threads": engine.threads, "window": cfg.window_size, "decoder_start": split,
           "replays": replays, "generate": args.generate, "repeat": args.repeat, "texts": source,
           "param_ratios": ratios, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "runs": []}
    for n_tokens in args.tokens:
        for kind in KINDS:
            for index, ids in enumerate(prompts(engine, texts[kind], n_tokens, args.prompts)):
                started = time.perf_counter()
                entry = {"kind": kind, "tokens": n_tokens, "prompt": index}
                if args.timing_only:  # one untimed warm-up round instead of the accuracy runs
                    timing(engine, ids, replays, 1)
                else:
                    entry["accuracy"] = accuracy(engine, ids, replays, args.generate, decoder)
                entry["timing"] = timing(engine, ids, replays, args.repeat)
                entry["wall_s"] = time.perf_counter() - started
                out["runs"].append(entry)
                print(f"  {kind} {n_tokens} #{index}: {entry['wall_s']:.0f} s", file=sys.stderr, flush=True)
                if args.out:  # what has run so far survives an interrupted bench
                    _write(args.out, {**out, "summary": summarize(out), "partial": True})
    out["summary"] = summarize(out)
    return out


def _write(path: str, out: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))


def summarize(out: dict) -> list[dict]:
    """Mean over prompts per (tokens, kind, replay): accuracy and timing rows."""
    rows = []
    ratio = out["param_ratios"]["model"]["ratio"]
    keys = sorted({(r["tokens"], r["kind"]) for r in out["runs"]}, key=lambda k: (k[0], KINDS.index(k[1])))
    for n_tokens, kind in keys:
        runs = [r for r in out["runs"] if (r["tokens"], r["kind"]) == (n_tokens, kind)]
        full_s = sum(r["timing"]["full"]["best_s"] for r in runs) / len(runs)
        for replay in out["replays"]:
            acc = [r["accuracy"]["by_replay"][str(replay)] for r in runs if "accuracy" in r]
            ced_s = sum(r["timing"][f"ced_{replay}"]["best_s"] for r in runs) / len(runs)
            medians = [median(r["timing"][f"ced_{replay}"]["all_s"]) / median(r["timing"]["full"]["all_s"]) for r in runs]
            def mean(key, acc=acc):
                return sum(float(a[key]) for a in acc) / len(acc) if acc else float("nan")
            rows.append({"tokens": n_tokens, "kind": kind, "replay": replay, "prompts": len(runs),
                         "full_s": full_s, "ced_s": ced_s, "time_ratio": ced_s / full_s,
                         "median_time_ratio": sum(medians) / len(medians),
                         "param_ratio": expected_ratio(ratio, n_tokens, replay),
                         "logits_rel_l2": mean("logits_rel_l2"), "argmax_agrees": mean("argmax_agrees"),
                         "diverges_at": mean("diverges_at"), "min_diverges_at": min((a["diverges_at"] for a in acc), default=-1),
                         "step_pick_agreement": mean("step_pick_agreement"),
                         "topk_jaccard": mean("topk_jaccard"), "routing_agreement": mean("routing_agreement")})
    return rows


def table(out: dict) -> str:
    head = (f"{'tokens':>6} {'kind':<5} {'R':>4} {'full s':>7} {'ced s':>7} {'ratio':>6} {'params':>6} "
            f"{'median':>6} {'logit relL2':>11} {'argmax':>6} {'parts at':>8} {'min':>4} {'picks':>5} {'top-k J':>7} {'routing':>7}")
    lines = [head]
    for r in out["summary"]:
        lines.append(f"{r['tokens']:>6} {r['kind']:<5} {r['replay']:>4} {r['full_s']:>7.3f} {r['ced_s']:>7.3f} "
                     f"{r['time_ratio']:>6.3f} {r['param_ratio']:>6.3f} {r['median_time_ratio']:>6.3f} "
                     f"{r['logits_rel_l2']:>11.4f} "
                     f"{r['argmax_agrees']:>6.2f} {r['diverges_at']:>8.1f} {r['min_diverges_at']:>4} "
                     f"{r['step_pick_agreement']:>5.2f} {r['topk_jaccard']:>7.3f} {r['routing_agreement']:>7.3f}")
    p = out["param_ratios"]
    lines.append(f"active params per prompt token, ced / full: this model {p['model']['ratio']:.3f}, "
                 f"release {p['release']['prefill'] / 1e9:.2f} B / {p['release']['decode'] / 1e9:.2f} B = "
                 f"{p['release']['ratio']:.3f}; 'params' column adds the R replayed tokens at full cost")
    return "\n".join(lines)


def figure(out: dict):
    """Accuracy against R (one line per prompt length and kind) as a plotly figure."""
    from plotly.subplots import make_subplots
    panels = [("logits_rel_l2", "last-token logits: relative L2 vs full"),
              ("diverges_at", f"greedy continuation: first differing step (of {out['generate']})"),
              ("topk_jaccard", "decoder top-k at generated tokens: Jaccard"),
              ("routing_agreement", "decoder routing at generated tokens: agreement")]
    fig = make_subplots(rows=2, cols=2, subplot_titles=[t for _, t in panels], horizontal_spacing=0.1,
                        vertical_spacing=0.16)
    colours = {"prose": "#0072B2", "code": "#D55E00"}
    dashes = ["solid", "dash", "dot", "dashdot"]
    lengths = sorted({r["tokens"] for r in out["summary"]})
    for i, (key, _) in enumerate(panels):
        row, col = i // 2 + 1, i % 2 + 1
        for n_tokens in lengths:
            for kind in KINDS:
                rows = [r for r in out["summary"] if r["tokens"] == n_tokens and r["kind"] == kind]
                if not rows:
                    continue
                fig.add_scatter(x=[r["replay"] for r in rows], y=[r[key] for r in rows], mode="lines+markers",
                                name=f"{kind}, {n_tokens} tokens", legendgroup=f"{kind}{n_tokens}", showlegend=i == 0,
                                line=dict(color=colours[kind], dash=dashes[lengths.index(n_tokens) % len(dashes)]),
                                row=row, col=col)
        fig.update_xaxes(type="log", tickvals=out["replays"], title_text="replay R (tokens)", row=row, col=col)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_layout(width=1000, height=720, template="plotly_white",
                      title=f"CED prefill vs full prefill on {Path(out['checkpoint']).name} "
                            f"({out['device']}, window {out['window']})",
                      legend=dict(orientation="h", y=-0.12))
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(ROOT / "assets" / "model"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--numerics", choices=("reference", "fp32"), default=None, help="default: the engine's")
    ap.add_argument("--kernels", choices=("auto", "on", "off"), default="auto", help="the Triton path (CUDA)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024], help="prompt lengths")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per kind and length")
    ap.add_argument("--replays", type=int, nargs="+", default=[1, 2, 4, 8], help="R as multiples of the window")
    ap.add_argument("--generate", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="timing rounds (best kept)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--png", help="draw accuracy against R to this PNG (plotly + kaleido)")
    ap.add_argument("--from-json", help="redraw --png from a results JSON instead of running")
    ap.add_argument("--timing-only", action="store_true", help="skip the accuracy runs (times only)")
    args = ap.parse_args()
    if args.from_json:
        out = json.loads(Path(args.from_json).read_text())
        out["summary"] = summarize(out)
    else:
        out = run(args)
        if args.out:
            _write(args.out, out)
    print(table(out))
    if args.png:
        try:
            figure(out).write_image(args.png, scale=1)
            print(f"figure written to {args.png}")
        except Exception as err:  # kaleido or its browser missing: the JSON is kept, redraw with --from-json
            print(f"no figure ({type(err).__name__}: {err}); redraw later with --from-json", file=sys.stderr)
    if args.out and not args.from_json:
        print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
