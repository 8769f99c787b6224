"""Which source lines launch work in one decode step (or a prefill): aten ops per engine line, per layer.

    python benches/launch_sites.py [--prefix 96] [--tokens 16] [--layers 0 2 20 24] [--top 20] [--plain]
                                   [--prefill] [--bytes] [--callers]

The shipped small model (assets/model, the release's architecture and role plan) on the kernel ops
(engine/ops/triton.py; on the CPU the kernels' references run, which the count leaves out: on the GPU
each kernel is one launch), `reference` numerics, the capture-safe forms a CUDA graph's capture takes
(engine.capture.branch_free): a prefill of --prefix tokens, then a step of --tokens, counted. Every aten
op of the step is charged to the innermost frame in engine/, per layer. A count is an upper bound on the
line's launches (views and host-side ops count too): it says where to look, without device time; the
release layer's profile (benches/release_layer.py --profile) says what each costs. --plain: the wrapped
numerics alone (no kernel ops), for comparison. (The eighteenth session's glue hunt, notes/kernels.md.)
--prefill: the prefix's own forward instead of the step (no capture-safe forms: a prefill is not captured).
--bytes: lines ranked by the bytes their ops read and write (tensor inputs and outputs; views, which alias an
input, count nothing), the glue that costs at prefill sizes, where a launch's fixed cost does not matter.
--callers: a line in the ops seam (engine/ops) charged with the model line that called it (`act` has many).
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
ENGINE, KERNELS, OPS = str(ROOT / "engine"), str(ROOT / "kernels"), str(ROOT / "engine" / "ops")


def _tensors(tree):
    """The tensors in an op's (nested) arguments or outputs."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def op_bytes(func, args, kwargs, out) -> int:
    """Bytes an op reads and writes: its tensor inputs and its outputs (an in-place or `out=` op's written
    tensors included); 0 for an op that moves nothing: a view, or a conversion to what its input already is
    (every output on an input's storage, and the op mutates nothing)."""
    inputs, outputs = list(_tensors((args, kwargs))), list(_tensors(out))
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    fresh = [t for t in outputs if t.untyped_storage().data_ptr() not in storages]
    if not fresh and not func._schema.is_mutable:
        return 0
    return sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)


class _SiteCounter(TorchDispatchMode):
    """Counts aten ops, and the bytes they move, by (layer, innermost engine/ line); ops under a kernels/ frame
    are not counted."""

    def __init__(self, layer_of, callers: bool = False):
        super().__init__()
        self.layer_of, self.callers, self.counts, self.bytes = layer_of, callers, Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        stack = traceback.extract_stack()[:-1]
        if not any(f.filename.startswith(KERNELS) for f in stack):
            site = next((f for f in reversed(stack) if f.filename.startswith(ENGINE)), None)
            if site is not None:
                where = f"{Path(site.filename).relative_to(ROOT)}:{site.lineno}  {(site.line or '').strip()[:80]}"
                if self.callers and site.filename.startswith(OPS):  # which model line asked the seam
                    caller = next((f for f in reversed(stack) if f.filename.startswith(ENGINE)
                                   and not f.filename.startswith(OPS)), None)
                    if caller is not None:
                        where += f"  <- {Path(caller.filename).relative_to(ROOT)}:{caller.lineno}"
                key = (self.layer_of(), where)
                self.counts[key] += 1
                self.bytes[key] += op_bytes(func, args, kwargs or {}, out)
        return out


def launch_sites(model, prefix: torch.Tensor, step: torch.Tensor, prefill: bool = False,
                 weigh_bytes: bool = False, callers: bool = False) -> dict[int, Counter]:
    """Per layer: aten ops of `model.forward(step)` after `model.forward(prefix)`, by engine line, with the
    capture-safe forms; prefill: of `model.forward(prefix)` itself. weigh_bytes: the bytes the ops move
    instead of their count. callers: a line of the ops seam (engine/ops) with the model line that called it."""
    from engine.capture import branch_free

    model.reset()
    if prefill:  # a first pass loads the weights and builds the tables: the counted one does neither
        with torch.inference_mode():
            model.forward(prefix)
        model.reset()
    current = {"layer": -1}
    counter = _SiteCounter(lambda: current["layer"], callers)
    for i, block in enumerate(model.blocks):
        def timed(*a, _forward=block.forward, _i=i, **k):
            current["layer"] = _i
            try:
                return _forward(*a, **k)
            finally:
                current["layer"] = -1
        block.forward = timed
    with torch.inference_mode():
        if prefill:
            with counter:
                model.forward(prefix)
        else:
            model.forward(prefix)
            with branch_free(), counter:
                model.forward(step)
    per_layer: dict[int, Counter] = {}
    for (layer, where), n in (counter.bytes if weigh_bytes else counter.counts).items():
        per_layer.setdefault(layer, Counter())[where] += n
    return per_layer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="default: one layer of each role")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--plain", action="store_true", help="the wrapped numerics without the kernel ops")
    ap.add_argument("--prefill", action="store_true", help="the prefix's forward (--prefix tokens), not a step")
    ap.add_argument("--bytes", action="store_true", help="rank lines by the bytes their ops move")
    ap.add_argument("--callers", action="store_true", help="an ops-seam line with the model line calling it")
    args = ap.parse_args(argv)
    from engine.run import api
    engine = api.load(kernels=not args.plain, threads=1)
    model = engine.model
    ids = torch.randint(5, engine.cfg.vocab_size, (args.prefix + args.tokens,), generator=torch.Generator().manual_seed(0))
    sites = launch_sites(model, ids[:args.prefix], ids[args.prefix:], prefill=args.prefill, weigh_bytes=args.bytes,
                         callers=args.callers)
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
        what = f"a {args.prefix}-token prefill" if args.prefill else f"a {args.tokens}-token step"
        unit = "bytes moved by aten ops" if args.bytes else "aten ops"
        print(f"\n## layer {layer} ({role.label}{' + Engram' if role.engram else ''}): {sum(counts.values())} {unit} in "
              f"{what}, {'plain numerics' if args.plain else 'kernel ops'}")
        for where, n in counts.most_common(args.top):
            print(f"{n:12d}  {where}" if args.bytes else f"{n:5d}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
