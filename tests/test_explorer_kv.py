"""The KV panel's numbers against hand computation and the tally's formulas."""

from __future__ import annotations

from engine.config import release_config
from engine.tally import cache_bytes_at, cache_breakdown_at
from explorer.kv_view import kv_explainer, kv_figure, kv_table, measured_lines, measured_vs_formula, window_note
from test_explorer_plan import small_config
from explorer_synth import synthetic_run

CFG = release_config()


def test_890_bytes_taken_apart():
    rows = kv_table(CFG)
    assert [r["layer"] for r in rows] == ["2", "8", "14", "20", "all"]
    assert [r["entries/token"] for r in rows[:4]] == [0.5, 0.5, 0.5, 1.0]
    assert all(r["entry B"] == "288" and r["key B"] == "68" for r in rows[:4])   # 256 + 32, 64 + 4
    assert rows[-1]["entries/token"] == 2.5
    assert rows[-1]["B/token"] == 2.5 * (288 + 68) == 890
    assert "890 B per token" in kv_explainer(CFG)
    assert "67.6 kB per layer" in window_note(CFG)      # 128 x 528


def test_chart_matches_the_tally():
    n = 1_000_000
    fig = kv_figure(CFG, n)
    picked = [t for t in fig.data if t.name == "picked"][0]
    assert picked.y[0] == cache_bytes_at(CFG, n) == 890 * n + 40 * 128 * 528
    total = [t for t in fig.data if t.name == "total"][0]
    for x, y in zip(total.x, total.y):
        assert y == max(cache_bytes_at(CFG, x), 1)
    glob = [t for t in fig.data if t.name.startswith("global KV")][0]
    assert glob.y[-1] == cache_breakdown_at(CFG, glob.x[-1])["global_kv"]


def test_other_config():
    cfg = small_config()   # sources 1, 4 at m=2 and 6 at m=1
    assert kv_table(cfg)[-1]["B/token"] == 2 * 356 / 2 + 356


def test_measured_hook():
    assert measured_vs_formula(CFG, None) is None
    run = synthetic_run(12)
    m = measured_vs_formula(CFG, run)
    assert m["context_len"] == 12 and m["total"] == 1500
    assert m["formula_total"] == cache_bytes_at(CFG, 12)
    fig = kv_figure(CFG, 4000, measured=m)
    assert [t for t in fig.data if t.name.startswith("engine held")][0].y[0] == 1500


def test_pending_compressor_state_is_its_own_line():
    """The new user's odd-length prompt: held 224,608 B against 221,536 B, with 3,072 B of pending state."""
    m = {"context_len": 199, "total": 224_608, "pending": 3_072, "formula_total": 221_536}
    first, second = measured_lines(m)
    assert "engine held 221,536 B; the formula gives 221,536 B (equal)." in first
    assert second.startswith("Pending compressor state: 3,072 B more")
    even = measured_lines({"context_len": 200, "total": 221_700, "pending": 0, "formula_total": 221_600})
    assert len(even) == 1 and "(a difference of +100 B)" in even[0]

