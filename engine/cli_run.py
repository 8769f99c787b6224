"""`python -m engine run` (a prompt through the engine, with probes) and `python -m engine eval`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .__main__ import Command, fmt_bytes, table
from .train import eval as evaluation
from .run.api import DEFAULT_CHECKPOINT, EngineError, load
from .ops import DEFAULT_NUMERICS, NUMERICS
from .safe_io import read_text

MAX_PROMPT_BYTES = 16 << 20   # far beyond any max_seq_len of text; a bigger file is the wrong file
MAX_GENERATE = 1 << 20        # a sane ceiling before the model's own max_seq_len check


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                   help="release-layout checkpoint folder (default: the shipped small model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    src.add_argument("--ids", help="comma-separated token ids instead of text (e.g. 0,523,77)")
    p.add_argument("--layer", type=int, action="append", help="layer to probe (repeatable; default: all)")
    p.add_argument("--generate", type=int, default=0, help="greedy tokens to generate after the prompt")
    p.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="reference: the official bf16 dtype flow (default); fp32: float32 between every op")
    p.add_argument("--image-span", action="append", default=[], metavar="START:END",
                   help="mark token positions START..END-1 as image positions (routes with bias_vl)")
    p.add_argument("--json", dest="json_out", help="write the probes as JSON to this file ('-' for stdout)")
    p.add_argument("--prefill", choices=("full", "ced"), default="full",
                   help="full: every layer over the prompt (the reference); ced: the encoder over the prompt, "
                        "the decoder over only its last --replay tokens")
    p.add_argument("--replay", type=int, help="ced: prompt tokens the decoder runs on (default: the window size)")


def _spans(values: list[str]) -> list[tuple[int, int]]:
    spans = []
    for v in values:
        try:
            a, b = (int(x) for x in v.split(":"))
        except ValueError:
            raise EngineError(f"--image-span {v!r}: expected START:END, e.g. 10:20") from None
        spans.append((a, b))
    return spans


def _run(args: argparse.Namespace) -> int:
    try:
        if args.generate < 0 or args.generate > MAX_GENERATE:
            raise EngineError(f"--generate must be 0..{MAX_GENERATE:,} (and the prompt plus the generated tokens "
                              "must fit in the model's max_seq_len)")
        if args.prompt_file:
            prompt = read_text(args.prompt_file, "prompt file", MAX_PROMPT_BYTES, EngineError,
                               missing="cannot read the prompt file (no such file)")
        elif args.ids is not None:
            try:
                prompt = [int(v) for v in args.ids.split(",") if v.strip()]
            except ValueError:
                raise EngineError(f"--ids {args.ids!r}: expected comma-separated integers") from None
        else:
            prompt = args.prompt
        engine = load(args.checkpoint, numerics=args.numerics)
        result = engine.run(prompt, layers=args.layer, image_spans=_spans(args.image_span), generate=args.generate,
                            prefill=args.prefill, replay=args.replay)
    except EngineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json_out:
        text = json.dumps(result.to_json())
        if args.json_out == "-":
            print(text)
            return 0
        Path(args.json_out).write_text(text)
    rows = []
    for L, lr in sorted(result.layers.items()):
        sel = "-" if lr.topk is None else f"{int((lr.topk[-1] >= 0).sum())} of {lr.n_entries}"
        experts = " ".join(str(e) for e in lr.routing["experts"][-1].tolist()) if lr.routing else "-"
        rows.append([L, lr.label, lr.kv_source if lr.kv_source is not None else "-",
                     lr.index_source if lr.index_source is not None else "-", sel, experts, f"{lr.time_s * 1e3:.1f}"])
    print(f"{len(result.token_ids)} tokens through {engine.cfg.n_layers} layers in {result.time_s:.2f} s "
          f"({engine.source}, {result.numerics} numerics)")
    if result.prefill == "ced":
        print(f"prefill: ced, the decoder over the last {min(result.replay, len(result.token_ids))} prompt tokens "
              f"({result.prefill_s:.2f} s)")
    print(table(["layer", "role", "KV from", "top-k from", "last token selects", "last token experts", "ms"], rows))
    cache = result.cache_bytes
    print(f"cache held: global {fmt_bytes(cache['global'])} (formula {fmt_bytes(result.kv_bytes_formula)}), "
          f"windows {fmt_bytes(cache['window'])}")
    if result.generated_ids:
        print(f"generated: {result.generated_text!r}")
    if args.json_out and args.json_out != "-":
        print(f"probes written to {args.json_out}")
    return 0


COMMANDS = [
    Command("run", "run a prompt through the engine and print (or save) the probes", _run_args, _run),
    Command("eval", "mean next-token loss and perplexity of a checkpoint on a text file", evaluation.add_arguments,
            evaluation.run),
]
