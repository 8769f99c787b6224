"""Held-out evaluation: mean next-token loss (nats/token) of a checkpoint over a text file.

    python -m engine eval [--checkpoint DIR] --text-file F [--max-len N] [--json]

Every position but the first is predicted exactly once: the text is cut into windows of at most
`max_len` tokens that overlap by one token (each window restarts the caches, so a window's first
token is context only). Also: a unigram baseline from the training split's token counts with add-one
smoothing, when those counts are available (assets/training/train_counts.npy, from the training split).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from ..safe_io import read_text

REPO = Path(__file__).resolve().parents[2]
TRAIN_COUNTS = REPO / "assets" / "training" / "train_counts.npy"  # copied from build/tokens by hand
# the held-out texts are a few MB; a larger file would take hours on the CPU and is likely the wrong file
MAX_TEXT_BYTES = 64 << 20


class EvalError(ValueError):
    """Bad input to the evaluation (file, sizes); the message says what."""


def windows(n_tokens: int, max_len: int) -> list[tuple[int, int]]:
    """[start, end) spans of at most max_len tokens, overlapping by one, covering 0..n_tokens."""
    if max_len < 2:
        raise EvalError(f"--max-len must be at least 2, got {max_len}")
    spans, start = [], 0
    while start < n_tokens - 1:
        end = min(start + max_len, n_tokens)
        spans.append((start, end))
        start = end - 1
    return spans


def token_losses(model, ids: list[int], max_len: int) -> "torch.Tensor":
    """Per-position next-token loss (nats) for positions 1..len-1 of ids: float64 [len-1]."""
    import torch  # (with the model: `python -m engine` builds its parser without torch)
    import torch.nn.functional as F

    out = []
    with torch.inference_mode():
        for start, end in windows(len(ids), max_len):
            chunk = torch.tensor(ids[start:end])
            model.reset()
            logits = model.forward(chunk)
            out.append(F.cross_entropy(logits[:-1].double(), chunk[1:], reduction="none"))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def unigram_loss(ids: list[int], counts: np.ndarray) -> float:
    """Mean loss of p(t) = (count_t + 1) / (N + V) over positions 1.. (training counts, add-one)."""
    counts = np.asarray(counts, dtype=np.float64)
    logp = np.log(counts + 1.0) - math.log(counts.sum() + counts.size)
    return float(-logp[np.asarray(ids[1:], dtype=np.int64)].mean())


def encode(engine, text: str, max_tokens: int = 0) -> list[int]:
    """Token ids of the text with <bos> first (no max_seq_len limit: the scoring is windowed)."""
    if not text.strip():
        raise EvalError("the text is empty")
    if engine.tokenizer is None:
        raise EvalError("this checkpoint has no tokenizer.json")
    ids = engine.tokenizer.encode(text, add_bos=True)
    return ids[:max_tokens] if max_tokens else ids


def evaluate(engine, ids: list[int], max_len: int = 2048, counts: np.ndarray | None = None) -> dict:
    """Loss, token count and perplexity of an `engine.run.api.Engine` over token ids."""
    if len(ids) < 2:
        raise EvalError("need at least two tokens to score")
    from ..run.api import one_thread
    with engine.lock, one_thread():
        losses = token_losses(engine.model, ids, min(max_len, engine.cfg.max_seq_len))
        engine.model.reset()
    loss = float(losses.mean())
    result = {"loss": loss, "tokens": int(losses.numel()), "perplexity": math.exp(loss),
              "max_len": max_len, "checkpoint": engine.source}
    if counts is not None:
        result["unigram_loss"] = unigram_loss(ids, counts)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=None, help="checkpoint folder (default: assets/model)")
    parser.add_argument("--text-file", required=True, help="UTF-8 text to score")
    parser.add_argument("--max-len", type=int, default=2048, help="window length in tokens (default 2048)")
    parser.add_argument("--max-tokens", type=int, default=0, help="score only the first N tokens (0: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine eval",
                                     description="Mean next-token loss of a checkpoint over a text file.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """`python -m engine eval`: loss, tokens and perplexity; errors as one line, exit 2."""
    from ..run.api import EngineError, load
    try:
        text = read_text(args.text_file, "text file", MAX_TEXT_BYTES, EvalError, missing="no such file")
        engine = load(args.checkpoint)
        ids = encode(engine, text, args.max_tokens)
        counts = np.load(TRAIN_COUNTS) if TRAIN_COUNTS.exists() else None
        result = evaluate(engine, ids, args.max_len, counts)
    except (EvalError, EngineError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(f"checkpoint  {result['checkpoint']}")
        print(f"tokens      {result['tokens']} (windows of {result['max_len']})")
        print(f"loss        {result['loss']:.4f} nats/token")
        print(f"perplexity  {result['perplexity']:.2f}")
        if "unigram_loss" in result:
            print(f"unigram     {result['unigram_loss']:.4f} nats/token (training counts, add-one)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
