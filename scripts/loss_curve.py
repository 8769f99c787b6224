"""The small model's training loss curve as a PNG (assets/README.md), from a training log.

    python3 scripts/loss_curve.py [--train-log LOG [LOG ...]] [--png assets/training/loss_curve.png]

Reads the `events` of a train_log.json (or the JSON lines of a train.log): the per-batch
cross-entropy of each logged step against the tokens seen, coloured by phase (dense warm-up,
sparse, FP8/FP4 quantization-aware), and the held-out losses measured at the end as points. Several
logs (a run, then runs continued from its checkpoint with --init) are drawn one after the other: each
log's tokens count on from where the previous one ended.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASE_COLOURS = {"dense": "#7f7f7f", "sparse": "#1f77b4", "quant": "#d62728"}


def read_events(path: Path) -> list[dict]:
    """Events from a train_log.json ({"events": [...]}) or a train.log of JSON lines (.gz or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        text = handle.read()
    try:
        return json.loads(text)["events"]
    except json.JSONDecodeError:  # not one JSON document: JSON lines
        pass
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def chained(logs: list[list[dict]], names: list[str] | None = None) -> list[dict]:
    """The events of consecutive runs as one run: step tokens offset by the tokens the earlier runs saw."""
    out, offset = [], 0
    for run, events in enumerate(logs):
        last = 0
        for e in events:
            if e.get("event") == "step":
                e = {**e, "tokens": e["tokens"] + offset, "run": names[run] if names else f"run {run + 1}"}
                last = e["tokens"]
            out.append(e)
        offset = max(offset, last)
    return out


def figure(events: list[dict], title: str):
    import plotly.graph_objects as go

    steps = [e for e in events if e.get("event") == "step"]
    fig = go.Figure()
    runs = list(dict.fromkeys(e.get("run", "") for e in steps))  # in order of appearance
    # (run, phase, tokens, ce): a logged step carries each phase's latest batch loss where the log
    # has it (ce_by_phase), else the logged step's own
    points = [(e.get("run", ""), phase, e["tokens"], ce) for e in steps
              for phase, ce in (e.get("ce_by_phase") or {e["phase"]: e["ce"]}).items()]
    for run in runs:  # one line per run and phase: a line never joins two runs
        for phase, colour in PHASE_COLOURS.items():
            rows = [(tokens, ce) for r, ph, tokens, ce in points if ph == phase and r == run]
            if rows:
                label = f"training batches, {phase} phase" + (f" ({run})" if len(runs) > 1 else "")
                fig.add_scatter(x=[t / 1e6 for t, _ in rows], y=[ce for _, ce in rows],
                                mode="lines+markers", name=label, line={"color": colour, "dash": "solid" if run == runs[-1] else "dot"})
    end = 0.0
    for e in events:
        if e.get("event") == "step":
            end = e["tokens"] / 1e6
        if e.get("event") != "heldout":
            continue
        fig.add_scatter(x=[end], y=[e["loss"]], mode="markers", marker={"size": 11, "symbol": "diamond"},
                        name=f"held-out {e['name']} ({e['loss']:.2f})")
    fig.update_layout(title=title, xaxis_title="tokens seen (millions)",
                      yaxis_title="cross-entropy (nats/token)", width=1150, height=520,
                      legend={"x": 1.02, "y": 1.0})  # beside the plot: it covered the late curves
    return fig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # not --log: kaleido's logistro parses sys.argv too, and --log is a prefix of its options
    ap.add_argument("--train-log", type=Path, nargs="+", default=[REPO / "assets" / "training" / "train_log.json"],
                    help="one or more train logs, in the order the runs continued each other")
    ap.add_argument("--run-names", nargs="+", help="a name per log for the legend (default: run 1, run 2, ...)")
    ap.add_argument("--png", type=Path, default=REPO / "assets" / "training" / "loss_curve.png")
    ap.add_argument("--title", default="Small model training on one H200: loss per batch")
    args = ap.parse_args(argv)
    logs = [read_events(path) for path in args.train_log]
    for path, events in zip(args.train_log, logs):
        if not any(e.get("event") == "step" for e in events):
            raise SystemExit(f"error: {path} holds no step events")
    if args.run_names and len(args.run_names) != len(logs):
        raise SystemExit(f"error: {len(args.run_names)} --run-names for {len(logs)} logs")
    events = chained(logs, args.run_names)
    figure(events, args.title).write_image(str(args.png), scale=1)
    print(f"written {args.png}")


if __name__ == "__main__":
    main()
