"""Training-step throughput (issue 13): tokens/s of the small model's training step, this tree against a
baseline tree measured in the same run.

    python benches/train_step.py --train TOKENS.npy [--baseline DIR] [--shapes 24x4096,40x4096]
        [--phases sparse,quant] [--out DIR] [--profile] [--current-env K=V,...] [--baseline-env K=V,...]

DIR holds an older `engine/` package (plus assets/configs and assets/tokenizer), e.g.
`git archive 93f5e8c engine assets/configs assets/tokenizer | tar -x -C build/train_baseline`. Each tree
runs in its own process (`--worker`), with the training run's settings (bf16 autocast, compiled parts,
activation checkpointing): per (shape, phase) the first step (compiles) is timed apart, then `--warm`
steps, then the median of `--steps` timed steps. The table gives tokens/s, peak memory, and the ratio
against the baseline at the same shape and phase. The baseline may be this tree itself with another
environment (`--baseline . --baseline-env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, or
`--baseline-env V41_FUSED_PICKS=0` for the picked entries gathered, the trainer's form before the in-place
kernels became its CUDA default). Goal: 100 k tokens/s in the sparse phase on an H200 (met: 106.7 k vs 91.3 k
gathered at 28 x 4,096, benches/results/train-step-h200.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fused_picks():
    """The V41_FUSED_PICKS setting as the tree's trainer reads it (older trees: "1" or not; a tree
    whose default is in place on CUDA measures the gathered form with V41_FUSED_PICKS=0)."""
    try:
        from engine.train.__main__ import fused_picks_setting
    except ImportError:
        return os.environ.get("V41_FUSED_PICKS") == "1"
    return fused_picks_setting(os.environ)


def _args_namespace(a) -> argparse.Namespace:
    """The training CLI's arguments, as both the current and older trees read them."""
    return argparse.Namespace(
        config=str(Path(a.tree) / "assets" / "configs" / "small.json"), train=a.train, batch=24, seq=4096,
        dense_batch=16, dense_seq=2048, lr=1e-4, kl_weight=1.0, margin=0.1, focus=0.5, seq_balance=a.seq_balance,
        gamma=0.005, bf16=True, compile=True, checkpoint=True, seed=0, cpu=False, tiny=False, budget_s=60.0,
        deadline_s=0.0, max_steps=0, dense_frac=0.1, quant_frac=0.2, dense_every=0, warmup=1, log_every=10 ** 9,
        profile_step=0, profile_out=a.profile_out, smoke=False, init="",
        fused_picks=_fused_picks())


def worker(a) -> None:
    import torch
    from engine.train.__main__ import build, load_stream
    from engine.train.loop import sample_batch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = True
    args = _args_namespace(a)
    cfg, run = build(args, device)
    stream = load_stream(a.train, device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for shape in a.shapes.split(","):
        batch, seq = (int(v) for v in shape.split("x"))
        for name in a.phases.split(","):
            phase = run.phases()[name]
            phase.batch, phase.seq = (batch * seq // args.dense_seq, args.dense_seq) if name == "dense" else (batch, seq)
            row = {"shape": shape, "phase": name, "tokens": phase.batch * phase.seq}
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                run.step(phase, sample_batch(stream, phase.batch, phase.seq, gen), 1e-4)
                sync()
                row["first_step_s"] = time.perf_counter() - t0
                for _ in range(a.warm):
                    run.step(phase, sample_batch(stream, phase.batch, phase.seq, gen), 1e-4)
                times = []
                for _ in range(a.steps):
                    ids = sample_batch(stream, phase.batch, phase.seq, gen)
                    sync()
                    t0 = time.perf_counter()
                    run.step(phase, ids, 1e-4)
                    sync()
                    times.append(time.perf_counter() - t0)
                row.update(step_s=statistics.median(times), best_s=min(times),
                           tok_s=row["tokens"] / statistics.median(times),
                           peak_gb=torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else 0.0)
                if a.profile and not any("profiled" in r for r in rows):
                    run.profiled_step(phase, sample_batch(stream, phase.batch, phase.seq, gen), 1e-4)
                    row["profiled"] = True
            except Exception as err:  # OOM or a failed compile: report the row, go on
                run.opt.zero_grad(set_to_none=True)
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            print(json.dumps(row), flush=True)
            rows.append(row)


def tree_env(tree: Path, extra: str, base: dict | None = None) -> dict:
    """A tree's process environment: `base` (this one's), the tree on PYTHONPATH, and `extra`'s
    KEY=VALUE pairs (comma-separated; a value may hold '=' and ':')."""
    pairs = {}
    for kv in filter(None, extra.split(",")):
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise SystemExit(f"environment setting {kv!r}: expected KEY=VALUE")
        pairs[key] = value
    return {**(os.environ if base is None else base), "PYTHONPATH": str(tree), **pairs}


def _run_tree(tree: Path, a, label: str) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree), "--train", a.train,
           "--shapes", a.shapes, "--phases", a.phases, "--warm", str(a.warm), "--steps", str(a.steps),
           "--seq-balance", str(a.seq_balance)]
    if a.profile and label == "current":
        cmd += ["--profile", "--profile-out", a.out or "."]
    extra = a.current_env if label == "current" else a.baseline_env
    env = tree_env(tree, extra)
    print(f"# {label}: {tree} {extra}", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.tree_timeout)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:  # keep the rows measured before the limit
        as_text = lambda b: b.decode() if isinstance(b, bytes) else (b or "")
        stdout, stderr, code = as_text(err.stdout), as_text(err.stderr), f"timeout after {a.tree_timeout:.0f} s"
    rows = []
    for line in stdout.splitlines():
        if line.startswith("{") and '"shape"' in line:  # (not the profiler's event line)
            rows.append(json.loads(line))
            print(f"  {line}", flush=True)
    if code:
        print(f"  {label} exited {code}: {stderr[-1500:]}", flush=True)
    return rows


def table(current: list[dict], baseline: list[dict]) -> str:
    base = {(r["shape"], r["phase"]): r for r in baseline if "tok_s" in r}
    lines = ["| shape | phase | step (s) | tokens/s | vs baseline | first step (s) | peak (GB) | baseline tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in current:
        b = base.get((r["shape"], r["phase"]))
        if "tok_s" not in r:
            lines.append(f"| {r['shape']} | {r['phase']} | {r.get('error', 'failed')} | | | | | |")
            continue
        ratio = f"{r['tok_s'] / b['tok_s']:.2f}x" if b else "n/a"
        base_tok_s = f"{b['tok_s']:,.0f}" if b else "n/a"
        lines.append(f"| {r['shape']} | {r['phase']} | {r['step_s']:.3f} | {r['tok_s']:,.0f} | {ratio} | "
                     f"{r['first_step_s']:.1f} | {r['peak_gb']:.1f} | {base_tok_s} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", default="", help="uint16 .npy token stream(s), comma-separated")
    p.add_argument("--baseline", default="", help="a tree holding the baseline engine/ package")
    p.add_argument("--shapes", default="24x4096")
    p.add_argument("--baseline-shapes", default="", help="shapes for the baseline (default: --shapes)")
    p.add_argument("--phases", default="sparse,quant")
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq-balance", type=float, default=0.0)
    p.add_argument("--profile", action="store_true", help="profile one step of the current tree (profile.txt)")
    p.add_argument("--profile-out", default="")
    p.add_argument("--out", default="", help="folder for train-step.md / .json")
    p.add_argument("--tree-timeout", type=float, default=3000, help="seconds per tree (current, baseline)")
    p.add_argument("--current-env", default="", help="KEY=VALUE,... set for the current tree's process only")
    p.add_argument("--baseline-env", default="", help="the same for the baseline's (e.g. an allocator setting to A/B)")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--tree", default=str(ROOT))
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return
    if not a.train:
        p.error("--train is required")
    current = _run_tree(ROOT, a, "current")
    baseline = []
    if a.baseline:
        a.shapes = a.baseline_shapes or a.shapes
        baseline = _run_tree(Path(a.baseline).resolve(), a, "baseline")
    text = table(current, baseline)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "train-step.md").write_text(text + "\n")
        (out / "train-step.json").write_text(json.dumps({"current": current, "baseline": baseline}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
