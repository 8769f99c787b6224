"""Which source lines launch work in one decode step: aten ops per engine line, per layer.

    python benches/launch_sites.py [--prefix 96] [--tokens 16] [--layers 0 2 20 24] [--top 20] [--plain]

The shipped small model (assets/model, the release's architecture and role plan) on the kernel ops
(engine/ops/triton.py; on the CPU the kernels' references run, which the count leaves out: on the GPU
each kernel is one launch), `reference` numerics, the capture-safe forms a CUDA graph's capture takes
(engine.capture.branch_free): a prefill of --prefix tokens, then a step of --tokens, counted. Every aten
op of the step is charged to the innermost frame in engine/, per layer. A count is an upper bound on the
line's launches (views and host-side ops count too): it says where to look, without device time; the
release layer's profile (benches/release_layer.py --profile) says what each costs. --plain: the wrapped
numerics alone (no kernel ops), for comparison. (The eighteenth session's glue hunt, notes/kernels.md.)
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENGINE, KERNELS = str(ROOT / "engine"), str(ROOT / "kernels")


class _SiteCounter(TorchDispatchMode):
    """Counts aten ops by (layer, innermost engine/ line); ops under a kernels/ frame are not counted."""

    def __init__(self, layer_of):
        super().__init__()
        self.layer_of, self.counts = layer_of, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        stack = traceback.extract_stack()[:-1]
        if not any(f.filename.startswith(KERNELS) for f in stack):
            site = next((f for f in reversed(stack) if f.filename.startswith(ENGINE)), None)
            if site is not None:
                where = f"{Path(site.filename).relative_to(ROOT)}:{site.lineno}  {(site.line or '').strip()[:80]}"
                self.counts[(self.layer_of(), where)] += 1
        return out


def launch_sites(model, prefix: torch.Tensor, step: torch.Tensor) -> dict[int, Counter]:
    """Per layer: aten ops of `model.forward(step)` after `model.forward(prefix)`, by engine line, with the
    capture-safe forms."""
    from engine.capture import branch_free

    model.reset()
    current = {"layer": -1}
    with torch.inference_mode():
        model.forward(prefix)
        for i, block in enumerate(model.blocks):
            def timed(*a, _forward=block.forward, _i=i, **k):
                current["layer"] = _i
                try:
                    return _forward(*a, **k)
                finally:
                    current["layer"] = -1
            block.forward = timed
        counter = _SiteCounter(lambda: current["layer"])
        with branch_free(), counter:
            model.forward(step)
    per_layer: dict[int, Counter] = {}
    for (layer, where), n in counter.counts.items():
        per_layer.setdefault(layer, Counter())[where] += n
    return per_layer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="default: one layer of each role")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--plain", action="store_true", help="the wrapped numerics without the kernel ops")
    args = ap.parse_args(argv)
    from engine.run import api
    engine = api.load(kernels=not args.plain, threads=1)
    model = engine.model
    ids = torch.randint(5, engine.cfg.vocab_size, (args.prefix + args.tokens,), generator=torch.Generator().manual_seed(0))
    sites = launch_sites(model, ids[:args.prefix], ids[args.prefix:])
    if args.layers is None:
        seen, layers = set(), []
        for role in model.plan:
            key = (role.tab, role.in_candidate_pool, role.engram)  # SWA / SWA + Engram / Full m=2 / ... / Reindex
            if key not in seen:
                seen.add(key)
                layers.append(role.layer)
    else:
        layers = args.layers
    for layer in layers:
        counts = sites.get(layer, Counter())
        role = model.plan[layer]
        print(f"\n## layer {layer} ({role.label}{' + Engram' if role.engram else ''}): {sum(counts.values())} aten ops in a "
              f"{args.tokens}-token step, {'plain numerics' if args.plain else 'kernel ops'}")
        for where, n in counts.most_common(args.top):
            print(f"{n:5d}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
