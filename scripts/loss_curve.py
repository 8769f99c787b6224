"""The small model's training loss curve as a PNG (assets/README.md), from a training log.

    python3 scripts/loss_curve.py [--log assets/training/train_log.json] [--png assets/training/loss_curve.png]

Reads the `events` of a train_log.json (or the JSON lines of a train.log): the per-batch
cross-entropy of each logged step against the tokens seen, coloured by phase (dense warm-up,
sparse, FP8/FP4 quantization-aware), and the held-out losses measured at the end as points.
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


def figure(events: list[dict], title: str):
    import plotly.graph_objects as go

    steps = [e for e in events if e.get("event") == "step"]
    fig = go.Figure()
    for phase, colour in PHASE_COLOURS.items():
        rows = [e for e in steps if e["phase"] == phase]
        if rows:
            fig.add_scatter(x=[e["tokens"] / 1e6 for e in rows], y=[e["ce"] for e in rows], mode="lines+markers",
                            name=f"training batches, {phase} phase", line={"color": colour})
    end = steps[-1]["tokens"] / 1e6 if steps else 0.0
    for e in (e for e in events if e.get("event") == "heldout"):
        fig.add_scatter(x=[end], y=[e["loss"]], mode="markers", marker={"size": 11, "symbol": "diamond"},
                        name=f"held-out {e['name']} ({e['loss']:.2f})")
    fig.update_layout(title=title, xaxis_title="tokens seen (millions)",
                      yaxis_title="cross-entropy (nats/token)", width=900, height=500,
                      legend={"x": 0.55, "y": 0.95})
    return fig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, default=REPO / "assets" / "training" / "train_log.json")
    ap.add_argument("--png", type=Path, default=REPO / "assets" / "training" / "loss_curve.png")
    ap.add_argument("--title", default="Small model training on one H200: loss per batch")
    args = ap.parse_args(argv)
    events = read_events(args.log)
    if not any(e.get("event") == "step" for e in events):
        raise SystemExit(f"error: {args.log} holds no step events")
    figure(events, args.title).write_image(str(args.png), scale=1)
    print(f"written {args.png}")


if __name__ == "__main__":
    main()
