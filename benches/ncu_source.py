"""Nsight Compute's source page (`ncu -i REP --page source --csv --print-source sass,cuda`) summed per source line:
where a kernel's warps stall, by line of the Triton source, with each line's top stall reasons and its executed
instructions. The CSV holds one section per source file, each a row per source line followed by its SASS rows.

    python benches/ncu_source.py ncu-_row_select_kernel-source.csv [--top 40] [--out table.md]
"""
from __future__ import annotations

import argparse
import csv
import lzma
from pathlib import Path

SAMPLES, INSTRUCTIONS = "Warp Stall Sampling (All Samples)", "Instructions Executed"


def _number(text: str) -> int:
    try:
        return int(float(text.replace(",", "")))
    except ValueError:
        return 0


def source_lines(rows: list[list[str]]) -> list[dict]:
    """The CSV's rows -> one dict per source line: file, line, source, samples, instructions, stalls {reason: n}."""
    out, path, header = [], "", None
    for r in rows:
        if not r:
            continue
        if r[0] == "File Path":
            path = r[1] if len(r) > 1 else ""
        elif r[0] == "Line No":
            header = {name: i for i, name in enumerate(r)}  # the metrics' names are unique ("Source" is not: unused)
        # a source line (its SASS rows have no line number, and an address)
        elif header and r[0] and len(r) > 2 and r[2] == "-":
            stalls = {name[len("stall_"):]: _number(r[i]) for name, i in header.items()
                      if name.startswith("stall_") and "(Not Issued)" not in name}
            out.append({"file": path, "line": int(r[0]), "source": r[1].strip(), "samples": _number(r[header[SAMPLES]]),
                        "instructions": _number(r[header[INSTRUCTIONS]]), "stalls": stalls})
    return out


def table(lines: list[dict], top: int = 40) -> list[str]:
    """The `top` source lines by stall samples, as a Markdown table with their share of all samples."""
    total = sum(line["samples"] for line in lines) or 1
    instructions = sum(line["instructions"] for line in lines)
    out = [f"{total} stall samples, {instructions:,} warp instructions executed", "",
           "| samples | share | instructions | file:line | source | top stalls |", "|---:|---:|---:|---|---|---|"]
    for line in sorted(lines, key=lambda x: -x["samples"])[:top]:
        reasons = sorted(line["stalls"].items(), key=lambda kv: -kv[1])[:3]
        why = ", ".join(f"{name} {n / max(line['samples'], 1):.0%}" for name, n in reasons if n)
        src = line["source"].replace("|", "\\|")[:80]
        out.append(f"| {line['samples']} | {line['samples'] / total:.1%} | {line['instructions']:,} | "
                   f"{Path(line['file']).name}:{line['line']} | `{src}` | {why} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="the source page as CSV (.xz read as such)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default=None, help="write the table here (default: print it)")
    args = ap.parse_args(argv)
    opener = lzma.open if args.csv.endswith(".xz") else open
    with opener(args.csv, "rt", newline="") as f:
        text = "\n".join(table(source_lines(list(csv.reader(f))), args.top)) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
