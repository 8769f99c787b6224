"""scripts/loss_curve.py: consecutive runs drawn as one curve."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("loss_curve", Path(__file__).resolve().parent.parent / "scripts" / "loss_curve.py")
loss_curve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loss_curve)


def _step(tokens, ce, phase="sparse"):
    return {"event": "step", "tokens": tokens, "ce": ce, "phase": phase}


def test_a_continued_run_counts_on_from_the_first_runs_tokens():
    first = [_step(100, 5.0, "dense"), _step(300, 4.0), {"event": "heldout", "name": "prose", "loss": 4.5}]
    second = [_step(50, 3.9, "dense"), _step(250, 3.5, "quant")]
    events = loss_curve.chained([first, second])
    assert [e["tokens"] for e in events if e["event"] == "step"] == [100, 300, 350, 550]
    assert first[1]["tokens"] == 300 and second[0]["tokens"] == 50  # inputs left as they were
    fig = loss_curve.figure(events, "t")
    held = [t for t in fig.data if t.name.startswith("held-out")]
    assert len(held) == 1 and held[0].x[0] == 300 / 1e6  # at the end of the run that measured it
    names = {t.name for t in fig.data}
    assert {"training batches, dense phase (run 1)", "training batches, dense phase (run 2)"} <= names
    assert "training batches, quant phase (run 2)" in names and "training batches, quant phase (run 1)" not in names


def test_each_phases_latest_loss_is_drawn_where_the_log_has_it():
    """With every logged step a dense one (--dense-every 5, --log-every 10), the sparse phase's batches
    still reach the curve through the log's ce_by_phase."""
    events = [{**_step(100, 3.1, "dense"), "ce_by_phase": {"dense": 3.1, "sparse": 2.8}},
              {**_step(200, 3.0, "dense"), "ce_by_phase": {"dense": 3.0, "sparse": 2.7}},
              _step(300, 2.6, "quant")]
    fig = loss_curve.figure(events, "t")
    lines = {t.name: (tuple(t.x), tuple(t.y)) for t in fig.data}
    assert lines["training batches, sparse phase"] == ((100 / 1e6, 200 / 1e6), (2.8, 2.7))
    assert lines["training batches, dense phase"] == ((100 / 1e6, 200 / 1e6), (3.1, 3.0))
    assert lines["training batches, quant phase"] == ((300 / 1e6,), (2.6,))
