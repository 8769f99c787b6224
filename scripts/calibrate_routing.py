"""Re-balance a trained checkpoint's routing biases on training text of every domain, in equal parts.

    python3 scripts/calibrate_routing.py [--checkpoint assets/model] [--out DIR] [--tokens 4096]

Training balanced each layer's experts over the training mix (about three parts code to one part
prose), with the aux-loss-free rule bias += gamma * sign(mean load - load) after each step. On prose
alone, experts that specialised in code then go nearly unused at some deep layers. This applies the same
rule on equal parts of TRAIN-split prose (the prose pack) and TRAIN-split code (this machine's installed
Python packages, split by engine.train.corpus_data.split_of): per round, one forward collects each
layer's unbiased router scores, then each layer's bias is stepped on those fixed scores until the loads
are even, then the next round re-collects (a layer's inputs move when the layers before it re-route).
Only `gate.bias` changes (it picks experts, it does not weight them); nothing held out is read.
`--layers L ...` moves only those layers' biases (the rest keep the training's balance).
Writes the checkpoint to --out (default: in place) and --report (JSON: the shares before/after).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from engine.run.api import load  # noqa: E402
from engine.run.probes import ProbeRequest  # noqa: E402

PACK = REPO / "build" / "corpus_pack" / "prose.txt.xz"


def train_texts(tokens: int, tokenizer) -> dict[str, list[int]]:
    """About `tokens` token ids per domain from TRAIN-split documents, each document after a <bos>."""
    import corpus_code as cc

    prose = [d for d in cc.prose_documents(PACK, cc.PROSE_MANIFEST) if d["split"] == "train"]
    sources = cc.installed_sources(None, None)
    for src in sources:  # a spread of each distribution's files: reading all ~22 k takes many minutes
        src["files"] = src["files"][::max(1, len(src["files"]) // 16)]
    code_docs, _ = cc.collect(sources, workers=2)
    code = [d for d in cc.dedupe_and_split(code_docs)[0] if d["split"] == "train" and d["domain"] == "code"]
    out = {}
    for domain, docs in (("prose", prose), ("code", code)):
        ids: list[int] = []
        for doc in docs[::max(1, len(docs) // 400)]:  # spread over packages, not the first one's files
            ids += tokenizer.encode(doc["text"], add_bos=True)[:1024]
            if len(ids) >= tokens:
                break
        out[domain] = ids[:tokens]
    return out


def router_scores(eng, ids: list[int], chunk: int) -> dict[int, torch.Tensor]:
    """Each layer's unbiased router scores [T, E] over `ids`, forwarded in chunks of `chunk` tokens."""
    scores: dict[int, list[torch.Tensor]] = {}
    for a in range(0, len(ids), chunk):
        collect: dict = {}
        with torch.inference_mode():
            eng.model.reset()
            eng.model.forward(torch.tensor(ids[a:a + chunk]), probes=ProbeRequest(kinds={"routing"}), collect=collect)
        for L, probe in collect.items():
            scores.setdefault(L, []).append(probe["routing"]["scores"].float())
    eng.model.reset()
    return {L: torch.cat(s) for L, s in scores.items()}


def loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Expert loads [..., E] of scores [..., T, E] with bias [..., E] added (any leading layer dims)."""
    chosen = (scores + bias.unsqueeze(-2)).topk(k, dim=-1).indices           # [..., T, k]
    counts = torch.zeros(*scores.shape[:-2], scores.shape[-1], device=scores.device)
    return counts.scatter_add_(-1, chosen.flatten(-2), torch.ones_like(chosen.flatten(-2), dtype=counts.dtype))


def balance(scores: torch.Tensor, bias: torch.Tensor, k: int, steps: int = 400) -> torch.Tensor:
    """The sign rule on fixed scores [L, T, E], every layer at once, with a step shrinking from 1e-2 to
    1e-4; per layer the most even bias [L, E] seen."""
    best, best_spread = bias.clone(), torch.full(bias.shape[:1], float("inf"))
    b = bias.clone()
    for i in range(steps):
        load_ = loads(scores, b, k)
        mean = load_.mean(-1, keepdim=True)
        spread = (load_.max(-1).values - load_.min(-1).values) / mean.squeeze(-1)
        better = spread < best_spread
        best[better], best_spread[better] = b[better], spread[better]
        b += 1e-2 * (1e-2 ** (i / steps)) * torch.sign(mean - load_)
    return best


def share_range(scores: dict, biases: dict, k: int) -> dict[int, tuple[float, float]]:
    out = {}
    for L, s in scores.items():
        load_ = loads(s, biases[L], k)
        out[L] = (round(float(load_.min() / load_.mean()), 3), round(float(load_.max() / load_.mean()), 3))
    return out


def rebalance(scores: dict, biases: dict, k: int, layers) -> dict:
    """`balance` on the given layers only; every other layer keeps its bias tensor as it is."""
    layers = list(layers)
    solved = balance(torch.stack([scores[L] for L in layers]), torch.stack([biases[L] for L in layers]), k)
    return {**biases, **{L: solved[i] for i, L in enumerate(layers)}}


def write_biases(checkpoint: Path, biases: dict[int, torch.Tensor]) -> None:
    """Replace layers.L.ffn.gate.bias in the shards that hold them (other tensors and metadata kept)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    by_shard: dict[str, dict[str, torch.Tensor]] = {}
    for L, b in biases.items():
        name = f"layers.{L}.ffn.gate.bias"
        by_shard.setdefault(index[name], {})[name] = b.float().contiguous()
    for shard, new in by_shard.items():
        path = checkpoint / shard
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        tensors.update(new)
        save_file(tensors, str(path), metadata=meta)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=REPO / "assets" / "model")
    ap.add_argument("--out", type=Path, help="write the calibrated checkpoint here (default: in place)")
    ap.add_argument("--report", type=Path, default=REPO / "assets" / "training" / "routing_calibration.json")
    ap.add_argument("--tokens", type=int, default=4096, help="training tokens per domain")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="re-balance only these layers' biases (default: every layer)")
    args = ap.parse_args(argv)
    out = args.out or args.checkpoint
    if out != args.checkpoint:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(args.checkpoint, out)
    eng = load(out)
    k = eng.model.cfg.experts_of(0)[1]
    texts = train_texts(args.tokens, eng.tokenizer)
    print(f"training text: {', '.join(f'{d} {len(v)} tokens' for d, v in texts.items())}", flush=True)
    ids = texts["prose"] + texts["code"]
    moe_layers = range(eng.model.cfg.n_layers)
    biases = {L: eng.model.weights.get(f"layers.{L}.ffn.gate.bias").float().clone() for L in moe_layers}
    report = {"tokens": {d: len(v) for d, v in texts.items()}, "rounds": []}
    for r in range(args.rounds):
        scores = router_scores(eng, ids, args.chunk)
        before = share_range(scores, biases, k)
        biases = rebalance(scores, biases, k, args.layers or moe_layers)
        after = share_range(scores, biases, k)
        report["rounds"].append({"before": before, "after_on_these_scores": after})
        print(f"round {r + 1}: min share {min(v[0] for v in before.values()):.3f} -> "
              f"{min(v[0] for v in after.values()):.3f} (on this round's scores)", flush=True)
        write_biases(out, biases)
        eng = load(out)
    final = share_range(router_scores(eng, ids, args.chunk), biases, k)
    report["final"] = final
    print(f"after {args.rounds} rounds: min share {min(v[0] for v in final.values()):.3f}, "
          f"max {max(v[1] for v in final.values()):.3f}")
    args.report.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
