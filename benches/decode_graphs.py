"""The engine's decode loop with and without its CUDA graphs (engine/model/graphs.py), on one model.

    python benches/decode_graphs.py [--checkpoint assets/model] [--device cuda] [--tokens 64] [--generate 128]
        [--repeat 3] [--out FILE.json]

Per mode (eager: every kernel launched by the host; graphs: each block's cache-free parts replayed as CUDA
graphs, the attention eager between them), one engine is loaded and `Engine.run` generates `--generate`
greedy tokens after a `--tokens`-token prompt, no probes: two warm runs (the kernels' compiles, the graphs'
recording), then `--repeat` timed runs; decode time = run time - prefill time, the median run. Both modes
must pick the same tokens. Prints a table (ms a token, tokens/s, the speed-up against eager measured in the
same run) and what the graphs did (pieces recorded, replays, refused and why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _prompt(engine, n: int) -> list[int]:
    """n token ids of held-out prose (the shipped sample), or of the vocabulary in order where there is none."""
    sample = ROOT / "assets" / "corpus" / "heldout_sample.txt"
    if engine.tokenizer is not None and sample.exists():
        ids = engine.encode(sample.read_text(encoding="utf-8")[: 40 * n])
        if len(ids) >= n:
            return ids[:n]
    return [i % engine.cfg.vocab_size for i in range(1, n + 1)]


def host_profile(engine, ids, generate: int, path: str) -> None:
    """cProfile of one more run (prefill and decode) into `path`: the host's time by function, the 40 largest."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.runcall(engine.run, ids, layers=[], probes=[], generate=generate)
    for order in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(40)
        with open(path, "a") as f:
            f.write(f"\n## by {order}\n{text.getvalue()}")


def measure(checkpoint, device: str, graphs: bool, tokens: int, generate: int, repeat: int,
            profile: str | None = None) -> dict:
    from engine.run.api import load
    engine = load(checkpoint, device=device, decode_graphs=graphs)
    ids = _prompt(engine, tokens)
    runs = []
    for i in range(2 + repeat):
        runs.append(engine.run(ids, layers=[], probes=[], generate=generate))
        print(f"[{'graphs' if graphs else 'eager'}] run {i}: prefill {runs[-1].prefill_s:.3f} s, decode "
              f"{runs[-1].time_s - runs[-1].prefill_s:.3f} s", file=sys.stderr, flush=True)
    if profile:
        host_profile(engine, ids, generate, f"{profile}-{'graphs' if graphs else 'eager'}.txt")
    timed = sorted(runs[2:], key=lambda r: r.time_s - r.prefill_s)[len(runs[2:]) // 2]
    decode_s = timed.time_s - timed.prefill_s
    row = {"mode": "graphs" if graphs else "eager", "decode_s": decode_s, "per_token_ms": 1e3 * decode_s / generate,
           "tokens_per_s": generate / decode_s, "prefill_s": timed.prefill_s, "picks": timed.generated_ids,
           "ops": type(engine.model.ops).__name__}
    g = engine.model.graphs
    if g is not None:
        row.update(recorded=g.recorded, replays=g.replays,
                   refused={f"{k[0]}:{k[1]}": why for k, why in g.refused.items()})
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the shipped small model)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=64, help="prompt tokens")
    p.add_argument("--generate", type=int, default=128, help="greedy tokens a run generates")
    p.add_argument("--repeat", type=int, default=3, help="timed runs a mode (after two warm ones)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--profile", help="also profile the host (cProfile) of one run a mode into PREFIX-MODE.txt")
    args = p.parse_args(argv)
    import torch
    modes = [False, True] if torch.device(args.device).type == "cuda" else [False]
    rows = [measure(args.checkpoint, args.device, graphs, args.tokens, args.generate, args.repeat, args.profile)
            for graphs in modes]
    eager = rows[0]
    print(f"decode after a {args.tokens}-token prompt, {args.generate} greedy tokens, {args.device}, "
          f"ops {eager['ops']}, torch {torch.__version__}")
    print("| mode | ms a token | tokens/s | x eager | same picks | graphs recorded | replays | refused |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        refused = "; ".join(f"{k} {v}" for k, v in r.get("refused", {}).items()) or "-"
        print(f"| {r['mode']} | {r['per_token_ms']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{eager['decode_s'] / r['decode_s']:.2f} | {r['picks'] == eager['picks']} | "
              f"{r.get('recorded', '-')} | {r.get('replays', '-')} | {refused[:300]} |")
    if len(modes) == 1:
        print("(graphs need a CUDA device: the eager row only)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["picks"] == eager["picks"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
