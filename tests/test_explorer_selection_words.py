"""Words and names (explorer/glossary.py) and the release-first header and KV rows
(explorer/release_view.py), against the release's published figures and hand-computed names."""

from __future__ import annotations

import hashlib
import re
from types import SimpleNamespace

import pytest

from engine.config import load_config
from engine.tally import tally_from_config
from explorer import glossary as gl, prompt as pr, release_view as rv
from explorer.figure import Figure

RELEASE = load_config(pr.RELEASE_CONFIG)


def test_every_term_the_page_names_is_in_the_glossary():
    # the CSA2 words the issue names, and those the captions and headings use
    for term in ("m (compress ratio)", "Reindex", "Reuse", "pre (collapse)", "comb", "tie", "selection recall",
                 "zero-score pick", "candidate pool", "balance bias", "runner-up"):
        assert term in gl.GLOSSARY and len(gl.GLOSSARY[term]) > 30
    md = gl.glossary_markdown(["comb", "Reuse"])
    assert md.splitlines()[0].startswith("- **Reuse**") and "- **comb**" in md   # glossary order
    assert all(c.endswith(".") for c in gl.CAPTIONS.values())


def test_export_names_carry_model_layer_query_and_prompt_hash():
    text = "def fib(n):"
    h = hashlib.sha256(text.encode()).hexdigest()[:8]
    assert gl.prompt_hash(text) == h
    assert gl.export_name("top-k", model="V4.1 live (shipped)", layer=24, query=120, prompt=text) == \
        f"v4-1-live-shipped_layer24_q120_p{h}_top-k"
    assert gl.export_name("kv cache", model="release") == "release_kv-cache"
    assert gl.export_title("top-k selections", model="live model", layer=24, query=7, prompt=text) == \
        f"Layer 24 · top-k selections · query 7 · live model · prompt {h}"


def test_titled_figure_keeps_its_plot_area():
    fig = Figure([dict(type="bar", y=[1, 2])], dict(height=200, margin=dict(l=5, r=5, t=8, b=30)))
    gl.titled(fig, "Layer 3 · routing")
    assert fig.layout.title.text == "Layer 3 · routing" and fig.layout.margin["t"] == 30 and fig.layout.height == 222
    fig.validated()


def test_release_headline_comes_first_with_the_live_model_labelled():
    shipped = load_config(pr.MODEL_DIR)
    h = rv.headline(RELEASE, tally_from_config(RELEASE), shipped, tally_from_config(shipped))
    assert "763.2B parameters" in h.release and "890 B of global KV per token" in h.release
    assert "40 layers + 3 DSpark stages" in h.release
    assert h.live.startswith("live model: ") and "same 40-layer plan, widths scaled" in h.live
    assert re.search(r"live model: 50\.\d+M parameters", h.live)
    assert rv.headline(RELEASE, tally_from_config(RELEASE), None, None).live is None
    folder = rv.headline(RELEASE, tally_from_config(RELEASE), RELEASE, tally_from_config(RELEASE), "path")
    assert folder.live.startswith("checkpoint folder: 763.2B") and "release widths" in folder.live
    other = SimpleNamespace(**{**vars(shipped), "engram_layer_ids": (1,)})
    assert not rv.same_plan(RELEASE, other) and "width 256 (release 5,120)" in rv.live_note(RELEASE, shipped)


def test_kv_rows_put_the_release_first_and_cap_the_live_context():
    shipped = load_config(pr.MODEL_DIR)
    rows = rv.kv_compare(RELEASE, shipped, 1_000_000)
    assert [r["model"] for r in rows] == ["release", "live model"]
    assert rows[0]["KV per token"] == "890 B" and rows[1]["context"] == f"{shipped.max_seq_len:,} (its max)"
    assert len(rv.kv_compare(RELEASE, None, 4096)) == 1


def test_maps_carry_colour_scales_and_line_charts_axis_titles():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from explorer import layer_views as lv
    from explorer_synth import synthetic_layer, synthetic_run
    T = 30
    run = synthetic_run(T, {24: synthetic_layer(T, k=4, n_experts=16)})
    probe = lv.layer_probe(run, 24)
    topk = lv.topk_figure(lv.topk_model(run, probe), query=3)
    sel_trace = next(t for t in topk.data if t.get("showscale"))
    assert "picked" in sel_trace["colorbar"]["title"]["text"]
    routing = lv.routing_heatmap(lv.routing_model(run, probe, 16), run["tokens"], colorbar_x=0.49)
    assert routing.data[0]["showscale"] and routing.data[0]["colorbar"]["x"] == 0.49
    assert "weight" in routing.data[0]["colorbar"]["title"]["text"]
    assert lv.mhc_lines_figure(probe, run["tokens"]).layout.yaxis.title.text == "mHC weight"
    comb = [t for t in lv.mhc_token_figure(probe, 3).data if t["type"] == "heatmap"]
    assert [t["showscale"] for t in comb] == [False, True]          # one 0-1 scale for both mixes
    for fig in (topk, routing):
        fig.validated()
