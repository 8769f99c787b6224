"""Header-only inventory of the full 48-shard release skeleton: engine.checkpoint.inventory.read_inventory
against safetensors' own safe_open(framework="numpy") header listing, measured in the same run.

    python benches/inventory.py [--dir SKELETON] [--repeat 5]

Without --dir a sparse skeleton is written to a temporary folder first (a few MB on disk)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors import safe_open  # noqa: E402

from engine.checkpoint.inventory import read_inventory  # noqa: E402
from engine.checkpoint.writer import write_skeleton
from engine.config import release_config  # noqa: E402
from engine.tally import tally_from_checkpoint  # noqa: E402


def safetensors_listing(folder: Path) -> int:
    """Baseline: open every shard with safetensors and read each tensor's dtype and shape."""
    n = 0
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, framework="numpy") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                piece.get_shape(), piece.get_dtype()
                n += 1
    return n


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.dir or write_skeleton(release_config(), Path(tmp) / "skeleton")
        read_inventory(folder), safetensors_listing(folder)          # warm the page cache
        base_t, base_n = timed(lambda: safetensors_listing(folder), args.repeat)
        inv_t, inv = timed(lambda: read_inventory(folder), args.repeat)
        tally_t, _ = timed(lambda: tally_from_checkpoint(folder), args.repeat)
        rows = [("safetensors safe_open listing (baseline)", base_t, base_n),
                ("engine read_inventory (validated, index cross-checked)", inv_t, len(inv)),
                ("engine tally_from_checkpoint (inventory + tally)", tally_t, len(inv))]
        print(f"{'method':<56} {'median s':>9} {'tensors':>8} {'vs baseline':>12}")
        for name, t, n in rows:
            print(f"{name:<56} {t:>9.3f} {n:>8,} {t / base_t:>11.2f}x")


if __name__ == "__main__":
    main()
