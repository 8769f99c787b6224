"""Train the small V4.1-Flash model and export it in the release layout.

    python -m engine.train train --train build/tokens/train.npy --out DIR [--budget-s 600] [--bf16]

The step's throughput, against an older tree in the same run: benches/train_step.py.

Token files are uint16 .npy streams (documents joined, each starting with <bos>); several may be
given, comma-separated, and are concatenated. `--heldout name=file.npy` (repeatable) is measured
at the end of the run (loss, zero-score picks, selection recall per index layer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from ..config import load_config
from ..tokenizer import load_tokenizer
from .loop import Run
from .params import Trainee

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "assets" / "configs" / "small.json"
TOKENIZER = REPO / "assets" / "tokenizer" / "tokenizer.json"


def fused_picks_setting(env) -> bool | None:
    """V41_FUSED_PICKS: "1" in place, "0" gathered, unset None (in place on CUDA: 1.17x the gathered
    step at 28 x 4,096 on the H200, benches/results/train-step-h200.md; gathered on the CPU, where the
    Triton kernels would need the interpreter)."""
    value = env.get("V41_FUSED_PICKS")
    return None if value is None else value == "1"


def load_stream(paths: str, device) -> torch.Tensor:
    """Concatenated uint16 token files as one int32 tensor on `device`."""
    arrays = [np.load(p, mmap_mode="r") for p in paths.split(",") if p]
    if not arrays:
        raise SystemExit("no token files given (--train)")
    return torch.from_numpy(np.concatenate(arrays).astype(np.int32)).to(device)


def build(args, device):
    cfg = load_config(args.config)
    if args.tiny:
        cfg = cfg.replace(dim=64, q_lora_rank=32, head_dim=32, rope_head_dim=16, n_heads=2, o_lora_rank=32,
                          index_n_heads=2, index_head_dim=32, moe_inter_dim=32, n_routed_experts=8,
                          n_activated_experts=2, window_size=8, index_topk=8, candidate_topk_blocks=4)
    tok = load_tokenizer(TOKENIZER)
    lookup = torch.tensor(tok.compressed_vocab()[0], dtype=torch.long)
    init = getattr(args, "init", "")
    trainee = Trainee.from_checkpoint(cfg, init, device) if init else Trainee(cfg, device, args.seed)
    return cfg, Run(cfg, trainee, lookup, args, device)


def load_compile_cache(path: str) -> str:
    """Load torch.compile's portable cache (a file an earlier run saved) so this run's compiles are
    cache hits; returns what happened, for the log. A missing or unreadable file only costs the compiles."""
    if not path or not Path(path).is_file():
        return "none"
    try:
        info = torch.compiler.load_cache_artifacts(Path(path).read_bytes())
    except Exception as err:  # a cache from another torch/triton build: compile as usual
        return f"not loaded ({type(err).__name__}: {str(err)[:120]})"
    if info is None:  # torch logs why (a checksum or unpickling failure) and loads nothing
        return "not loaded (unreadable cache file)"
    return f"loaded {Path(path).stat().st_size} bytes"


def save_compile_cache(path: str) -> int:
    """Write what this process compiled as one portable blob (torch.compiler.save_cache_artifacts);
    returns its size (0: nothing compiled)."""
    if not path:
        return 0
    saved = torch.compiler.save_cache_artifacts()
    if not saved:
        return 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(saved[0])
    return len(saved[0])


def cmd_train(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    cache = load_compile_cache(args.compile_cache)
    cfg, run = build(args, device)
    run.note(event="compile_cache", state=cache)
    stream = load_stream(args.train, device)
    run.note(event="init", params=sum(p.numel() for p in run.params), train_tokens=int(stream.numel()))
    extra = load_stream(args.extra, device) if args.extra else None
    run.train(stream, extra, args.extra_share)
    if args.compile_cache_out:
        run.note(event="compile_cache_saved", bytes=save_compile_cache(args.compile_cache_out))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # export before the held-out evaluation: a run cut short there must still leave its checkpoint
    from ..checkpoint.writer import write_checkpoint
    model_dir = out / "model"
    write_checkpoint(cfg, model_dir, tensors=run.trainee.export_tensors(), n_shards=args.n_shards)
    run.note(event="exported", bytes=sum(f.stat().st_size for f in model_dir.iterdir()))
    (out / "train_log.json").write_text(json.dumps(run.log, indent=1))
    for spec in args.heldout:
        name, path = spec.split("=", 1)
        tokens = torch.from_numpy(np.load(path).astype(np.int32)).to(device)
        run.log.setdefault("heldout", {})[name] = run.heldout(name, tokens, args.eval_seq, args.eval_windows,
                                                              fake_quant=args.quant_frac > 0)
        (out / "train_log.json").write_text(json.dumps(run.log, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.train", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train")
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--train", required=True, help="comma-separated uint16 .npy token files")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dense-batch", type=int, default=32)
    p.add_argument("--dense-seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--margin", type=float, default=0.1, help="weight of the indexer's margin term")
    p.add_argument("--focus", type=float, default=0.0,
                   help="weight of the focus term in dense steps: -log(share of the attention's mass on "
                        "the indexer's top-k), which trains the selection recall the probes measure")
    p.add_argument("--seq-balance", type=float, default=0.0,
                   help="weight of DeepSeek-V3's sequence-wise expert-balance loss (each sequence, so each "
                        "domain, spread over the experts; the routing bias balances only the whole batch)")
    p.add_argument("--gamma", type=float, default=0.005, help="routing-bias step of the balancing rule")
    p.add_argument("--bf16", action="store_true", help="bf16 matrix products (autocast)")
    p.add_argument("--compile", action="store_true", help="torch.compile the elementwise-heavy parts (CUDA)")
    p.add_argument("--checkpoint", action="store_true", help="recompute attention, MoE and mHC in the backward")
    p.add_argument("--fused-picks", action="store_true", default=fused_picks_setting(os.environ),
                   help="attend the picked entries in place (kernels/sparse_attn_train.py), not gathered; "
                        "default: V41_FUSED_PICKS=1 on, =0 off, unset: on where the device is CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--budget-s", type=float, default=600.0,
                   help="seconds of training, each phase's first (compiling) step not counted")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="wall-clock limit of the loop, compiling included (0: none); the budget shrinks to fit")
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--dense-frac", type=float, default=0.15)
    p.add_argument("--quant-frac", type=float, default=0.2)
    p.add_argument("--dense-every", type=int, default=0, help="in the sparse phase, every N-th step dense (0: none)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--profile-step", type=int, default=0,
                   help="profile this step (torch.profiler): profile.txt in --profile-out")
    p.add_argument("--profile-out", default="")
    p.add_argument("--smoke", action="store_true", help="split --max-steps evenly over the three phases")
    p.add_argument("--out", required=True)
    p.add_argument("--init", default="", help="continue from this exported checkpoint (dequantized)")
    p.add_argument("--extra", default="", help="comma-separated token files of a second stream (prose)")
    p.add_argument("--extra-share", type=float, default=0.0, help="share of each batch from --extra")
    p.add_argument("--heldout", action="append", default=[], help="name=tokens.npy, measured at the end")
    p.add_argument("--eval-seq", type=int, default=2048)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--n-shards", type=int, default=4)
    p.add_argument("--compile-cache", default="",
                   help="a torch.compile cache blob an earlier run saved (--compile-cache-out): loaded first")
    p.add_argument("--compile-cache-out", default="", help="save this run's compile cache here")
    args = parser.parse_args(argv)
    cmd_train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
