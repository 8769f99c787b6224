"""What the training forward keeps for its backward, by tensor shape class: bytes per token.

    python benches/train_memory.py [--seq 512] [--batch 1] [--no-checkpoint] [--fp32]

Runs one forward of engine/train/batched.py (the small config, random weights, the run's settings:
bf16 autocast, activation checkpointing, the balance term) on the CPU under a saved-tensors hook and
sums each saved storage once, grouped by shape with B*T and T named. Weights show up too (fixed
sizes: they fade as T grows). With checkpointing on, what the checkpointed parts keep as their
inputs is held by the checkpoint's own hooks and not seen here; --no-checkpoint shows everything.
On the H200 the sparse step at 24 x 4,096 peaked at 109 GB (benches/results/train-step-h200.md);
bytes per token x tokens per step is the activation part of that.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import load_config  # noqa: E402
from engine.model.engram import EngramLayout  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from engine.train.batched import BatchedForward, StepOptions  # noqa: E402
from engine.train.params import Trainee  # noqa: E402


def census(batch: int, seq: int, bf16: bool, checkpoint: bool) -> tuple[int, list]:
    cfg = load_config(ROOT / "assets" / "configs" / "small.json")
    tok = load_tokenizer(ROOT / "assets" / "tokenizer" / "tokenizer.json")
    lookup = torch.tensor(tok.compressed_vocab()[0], dtype=torch.long)
    trainee = Trainee(cfg, "cpu", seed=0)
    fwd = BatchedForward(cfg, trainee.get, EngramLayout.from_config(cfg), lookup, bf16=bf16, checkpoint=checkpoint)
    kept: dict[int, tuple] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        kept.setdefault(storage.data_ptr(), (tuple(t.shape), str(t.dtype).removeprefix("torch."), storage.nbytes()))
        return t

    ids = torch.randint(5, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fwd(ids, StepOptions(margin=0.1, seq_balance=True))
    tokens = batch * seq
    groups: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for shape, dtype, nbytes in kept.values():
        named = tuple("B*T" if d == tokens else "T" if d == seq else "B" if d == batch and batch > 1 else d for d in shape)
        groups[(named, dtype)] += nbytes
        counts[(named, dtype)] += 1
    return tokens, [(key, nbytes, counts[key]) for key, nbytes in groups.most_common()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    ap.add_argument("--rows", type=int, default=20)
    a = ap.parse_args(argv)
    tokens, rows = census(a.batch, a.seq, not a.fp32, not a.no_checkpoint)
    total = sum(n for _, n, _ in rows)
    print(f"{a.batch} x {a.seq} tokens: {total / 1e6:.1f} MB kept for the backward, {total / tokens / 1e3:.0f} KB per token"
          f" ({total / tokens * 98304 / 2**30:.0f} GiB at 24 x 4,096 if all of it scaled with tokens)\n")
    print("| share | bytes per token | tensors | shape | dtype |\n|---|---|---|---|---|")
    for (shape, dtype), nbytes, n in rows[: a.rows]:
        print(f"| {nbytes / total:.1%} | {nbytes / tokens:,.0f} | {n} | {list(shape)} | {dtype} |")


if __name__ == "__main__":
    main()
