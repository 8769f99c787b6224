"""Prompt through all 40 layers on the CPU, with every probe and without: time and peak memory.

    python benches/engine_cpu.py [--checkpoint DIR] [--sizes 512 2048 8192] [--repeat 3] [--numerics reference]

Uses the shipped small model (assets/model); without it, a random-weight checkpoint of
assets/configs/small.json is written to build/bench-small first. Each measurement runs in a fresh
process so its peak RSS is its own; times are the median (and best) of --repeat runs after a warm-up
run, in the engine's default numerics (`reference`) unless --numerics says otherwise.
Goal (PERFORMANCE.md): 2,048 tokens under 2 s on 2 cores. Columns: the engine as it runs by default
(two threads: the prompt's halves in a wavefront, engine/run/pipeline.py) with every probe and without,
and the one-thread baseline measured in the same run (every op of the engine runs on one torch
thread; see engine.run.api.one_thread for why not torch's intra-op threads).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _child(checkpoint: str, n: int, probes: bool, threads: int, repeat: int, numerics: str) -> dict:
    import statistics

    import torch

    from engine.run import api
    engine = api.load(checkpoint, threads=threads, numerics=numerics)
    ids = torch.randint(5, engine.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    kinds = ("topk", "mhc", "routing", "norms", "timing") if probes else ()
    engine.run(ids, probes=kinds)  # warm: weights read and dequantized once
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = engine.run(ids, probes=kinds)
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    payload = json.dumps(result.to_json()) if probes else ""
    to_json = time.perf_counter() - started
    return {"seconds": statistics.median(times), "best_s": min(times), "to_json_s": to_json, "json_mb": len(payload) / 1e6,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _measure(checkpoint: str, n: int, probes: bool, threads: int, repeat: int, numerics: str) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); from benches.engine_cpu import _child; "
            f"print(json.dumps(_child({checkpoint!r}, {n}, {probes}, {threads}, {repeat}, {numerics!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _checkpoint(path: str | None) -> str:
    if path:
        return path
    shipped = ROOT / "assets" / "model"
    if (shipped / "config.json").exists():
        return str(shipped)
    target = ROOT / "build" / "bench-small"
    if not (target / "config.json").exists():
        from engine.checkpoint.writer import write_checkpoint
        from engine.config import load_config
        from engine.checkpoint.weights import random_weights
        cfg = load_config(ROOT / "assets" / "configs" / "small.json")
        write_checkpoint(cfg, target, tensors=random_weights(cfg, 0))
        (target / "tokenizer.json").write_bytes((ROOT / "assets" / "tokenizer" / "tokenizer.json").read_bytes())
    return str(target)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint")
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--numerics", default="reference", help="engine/ops numerics: reference (default) or fp32")
    args = ap.parse_args()
    checkpoint = _checkpoint(args.checkpoint)
    print(f"checkpoint: {checkpoint}; numerics {args.numerics}; medians of {args.repeat} runs (best in brackets)")
    print(f"{'tokens':>7} {'probes s':>15} {'no-probe s':>10} {'ratio':>6} {'1-thread s':>10} {'speed-up':>8} "
          f"{'tok/s':>7} {'JSON s':>7} {'JSON MB':>8} {'peak MB':>8} {'goal':>12}")
    for n in args.sizes:
        with_p = _measure(checkpoint, n, True, 2, args.repeat, args.numerics)
        without = _measure(checkpoint, n, False, 2, args.repeat, args.numerics)
        single = _measure(checkpoint, n, True, 1, args.repeat, args.numerics)
        goal = "<2 s: " + ("met" if with_p["seconds"] < 2 else "missed") if n == 2048 else ""
        probes = f"{with_p['seconds']:.2f} ({with_p['best_s']:.2f})"
        print(f"{n:>7} {probes:>15} {without['seconds']:>10.2f} "
              f"{with_p['seconds'] / without['seconds']:>6.2f} {single['seconds']:>10.2f} "
              f"{single['seconds'] / with_p['seconds']:>8.2f} {n / with_p['seconds']:>7.0f} "
              f"{with_p['to_json_s']:>7.2f} {with_p['json_mb']:>8.1f} {with_p['peak_rss_mb']:>8.0f} {goal:>12}")


if __name__ == "__main__":
    main()
