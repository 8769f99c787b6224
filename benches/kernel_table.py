"""One table of every kernel's newest figure: each case's row from the newest of the given bench logs
(benches/kernels.py writes one kernels-log.json per run; runs often time only some cases).

python benches/kernel_table.py [LOG.json ...] [--out benches/results/kernels-h200-current.md]
(default logs: benches/results/kernels-h200*-log.json). Every row names the run it comes from; the
floor and ceiling fraction are that run's own (its ceilings were measured in it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def newest_rows(logs: dict[str, dict]) -> list[tuple[dict, str, str]]:
    """(row, log name, date) for each case name, from the log with the newest date; cases in the order
    of their first appearance, newest log first."""
    by_date = sorted(logs.items(), key=lambda kv: kv[1].get("date", ""), reverse=True)
    picked: dict[str, tuple[dict, str, str]] = {}
    for name, log in by_date:
        for row in log.get("rows", []):
            picked.setdefault(row["name"], (row, name, log.get("date", "?")))
    return list(picked.values())


def table(logs: dict[str, dict]) -> str:
    lines = ["# Kernel benchmarks: each case's newest run", "",
             "Composed by benches/kernel_table.py from " + ", ".join(sorted(logs)) + ". Times are medians; "
             "floor and % are each run's own (its ceilings measured in it).", "",
             "| kernel, case | time (us) | floor (us) | % of ceiling | goal (us) | achieved | check | run |",
             "|---|---|---|---|---|---|---|---|"]
    for r, name, date in newest_rows(logs):
        frac = 100 * r["floor_us"] / r["us"]
        lines.append(f"| {r['name']} | {r['us']:.1f} | {r['floor_us']:.1f} ({r['limit']}) | {frac:.0f}% | "
                     f"{r['goal_us']} | {r['extra']} | {r['check']} | {name}, {date} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="*")
    ap.add_argument("--out", default=str(RESULTS / "kernels-h200-current.md"))
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.logs] or sorted(RESULTS.glob("kernels-h200*-log.json"))
    logs = {p.name: json.loads(p.read_text()) for p in paths}
    text = table(logs)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
