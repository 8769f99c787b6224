"""The small model's evidence (assets/README.md), measured on held-out text on the CPU.

    python3 scripts/model_evidence.py [--checkpoint DIR] [--tokens 8192] [--out assets/training/evidence.json]

Per domain (held-out prose and code: assets/corpus/heldout_prose.txt, heldout_code.txt):
- loss (nats/token) of the checkpoint through the engine (FP8 activations, as served), against the
  in-sample unigram of the same tokens (the entropy of their own token frequencies: the best any
  unigram model can do on them);
- per Full / Reindex layer, the share of selected entries whose index score is exactly 0;
- per selection layer, the selection recall (the share of the global attention mass, window and
  sink included in the softmax, that the picks capture if the layer attended every visible entry),
  and the same for "the most recent k entries" (engine/train/batched.py analysis mode, on the
  checkpoint's dequantized weights);
- per layer, each routed expert's load over its fair share (min and max);
then greedy continuations of three held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.run.api import DEFAULT_CHECKPOINT, load  # noqa: E402
from engine.model.engram import EngramLayout  # noqa: E402
from engine.train.eval import token_losses  # noqa: E402
from engine.run.probes import ProbeRequest  # noqa: E402
from engine.roles import FULL, REINDEX  # noqa: E402
from engine.train.batched import BatchedForward, StepOptions  # noqa: E402
from engine.train.params import Trainee  # noqa: E402

DOMAINS = {"prose": REPO / "assets" / "corpus" / "heldout_prose.txt",
           "code": REPO / "assets" / "corpus" / "heldout_code.txt"}
PROMPTS = [("prose", 0, 160), ("code", 0, 160), ("prose", 4000, 160)]  # (domain, start token, length)


def unigram_entropy(ids: list[int]) -> float:
    counts = Counter(ids[1:])
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


@torch.no_grad()
def measure(eng, trainee_fwd, ids: list[int], window: int) -> dict:
    cfg = eng.model.cfg
    losses = token_losses(eng.model, ids, window)
    zero, loads, recall, recent = {}, {}, {}, {}
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start: start + window])
        if chunk.numel() < 2 * cfg.window_size:
            break
        collect: dict = {}
        eng.model.reset()
        eng.model.forward(chunk, probes=ProbeRequest(kinds={"topk", "routing"}), collect=collect)
        for L, probe in collect.items():
            role = eng.model.plan[L]
            if role.role in (FULL, REINDEX) and "topk" in probe:
                valid = probe["topk"] >= 0
                z = ((probe["topk_scores"] == 0) & valid).sum().item()
                zero.setdefault(L, [0, 0])
                zero[L][0] += z
                zero[L][1] += valid.sum().item()
            counts = torch.bincount(probe["routing"]["experts"].flatten(), minlength=cfg.n_routed_experts)
            loads[L] = loads.get(L, 0) + counts
        usable = chunk.numel() // cfg.window_size * cfg.window_size
        out = trainee_fwd(chunk[:usable].view(1, -1), StepOptions(analysis=True, position_ties=True))
        for L, r in out.recall.items():
            recall.setdefault(L, []).append(float(r["recall"]))
            recent.setdefault(L, []).append(float(r["recent_k"]))
    eng.model.reset()
    return {
        "tokens": len(ids),
        "loss": float(losses.mean()),
        "unigram_in_sample": unigram_entropy(ids),
        "zero_score_picks": {str(L): round(z / max(n, 1), 4) for L, (z, n) in sorted(zero.items())},
        "recall": {str(L): round(sum(v) / len(v), 4) for L, v in sorted(recall.items())},
        "recent_k_recall": {str(L): round(sum(v) / len(v), 4) for L, v in sorted(recent.items())},
        **expert_shares(loads),
        "_loads": loads,  # summed over domains by main(); not written out
    }


def expert_shares(loads: dict) -> dict:
    """Per layer, the least and most used routed expert as a multiple of the fair share."""
    share = {L: (c.float() / c.float().mean()) for L, c in loads.items()}
    return {"expert_share_min": {str(L): round(float(s.min()), 3) for L, s in sorted(share.items())},
            "expert_share_max": {str(L): round(float(s.max()), 3) for L, s in sorted(share.items())}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--tokens", type=int, default=8192, help="held-out tokens per domain")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--generate", type=int, default=48)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    eng = load(args.checkpoint)
    cfg = eng.model.cfg
    trainee = Trainee.from_checkpoint(cfg, args.checkpoint)
    lookup = torch.tensor(eng.tokenizer.compressed_vocab()[0], dtype=torch.long)
    fwd = BatchedForward(cfg, trainee.get, EngramLayout.from_config(cfg), lookup)
    report: dict = {"checkpoint": str(args.checkpoint), "domains": {}, "continuations": []}
    texts = {d: p.read_text(encoding="utf-8") for d, p in DOMAINS.items() if p.exists()}
    all_loads: dict = {}
    for domain, text in texts.items():
        ids = eng.tokenizer.encode(text, add_bos=True)[: args.tokens]
        measured = measure(eng, fwd, ids, args.window)
        for L, c in measured.pop("_loads").items():
            all_loads[L] = all_loads.get(L, 0) + c
        report["domains"][domain] = measured
        print(domain, json.dumps(measured), flush=True)
    # the held-out split as a whole: every domain's tokens, equal parts
    report["held_out_all"] = {"domains": sorted(texts), **expert_shares(all_loads)}
    for domain, start, length in PROMPTS:
        if domain not in texts:
            continue
        ids = eng.tokenizer.encode(texts[domain], add_bos=False)[start: start + length]
        prompt = eng.tokenizer.decode(ids)
        result = eng.run(prompt, layers=[], generate=args.generate)
        report["continuations"].append({"domain": domain, "prompt": prompt, "output": result.generated_text})
        print(repr(prompt[-120:]), "->", repr(result.generated_text), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
