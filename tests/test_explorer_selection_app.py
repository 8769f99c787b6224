"""The issue-14 sections of the page with Streamlit's AppTest: the shared query, the scores behind the
picks and their captions, the glossary, the release-first header and KV rows; and, on the shipped model,
the recall asked for on a Reuse layer (its own recall, its source layer's runner-ups)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from explorer_synth import synthetic_layer, synthetic_run

APP = str(Path(__file__).resolve().parents[1] / "app.py")


def _run(query: dict | None = None, timeout: int = 60) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=timeout)
    for key, value in (query or {}).items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def _captions(at) -> str:
    return "\n".join(c.value for c in at.caption)


def test_saved_run_shows_scores_shared_query_and_glossary(tmp_path, monkeypatch):
    T = 30
    layer = synthetic_layer(T, k=4, n_experts=32, seed=2)
    layer["topk"][20], layer["topk_scores"][20] = [3, 5, 9, 11], [0.5, 0.0, 0.0, 0.25]
    path = tmp_path / "run.json"
    path.write_text(json.dumps(synthetic_run(T, {24: layer})))
    monkeypatch.setenv("EXPLORER_RUN_JSON", str(path))
    monkeypatch.setenv("EXPLORER_SOURCE", "config")
    at = _run()
    assert at.slider(key="query_pos").value == T - 1
    assert "Each bar is one entry's score from the indexer for query 29" in _captions(at)
    at.slider(key="query_pos").set_value(20).run()
    text = _captions(at)
    # one query for every view: the scores, the mHC token and the gate margins all say 20
    assert "for query 20" in text and "2 of 4 picks scored exactly 0" in text
    assert "Token 20: " in text and "token 20's 6 chosen experts" in text
    md = "\n".join(m.value for m in at.markdown)
    assert "picks (" in md and "scored exactly 0" in md
    assert "Runner-ups and selection recall need the model" in text     # a saved run: no engine to ask
    assert any(e.label.startswith("Glossary") for e in at.expander)
    assert "**selection recall**" not in md          # built only when opened
    at.session_state["glossary_box"] = True
    at.run()
    md = "\n".join(m.value for m in at.markdown)
    assert "**selection recall**" in md and "**comb**" in md
    # release first: config only shows the release and no live column
    assert "(release config)" in md and "live model:" not in md


@pytest.mark.skipif(not (Path(__file__).resolve().parents[1] / "assets" / "model" / "config.json").exists(),
                    reason="the shipped model is not in assets/model")
def test_shipped_model_reuse_layer_gets_its_own_recall(monkeypatch):
    monkeypatch.setenv("EXPLORER_SOURCE", "shipped")
    at = _run({"layer": "25"}, timeout=300)
    md = "\n".join(m.value for m in at.markdown)
    assert "live model: " in md and "same 40-layer plan" in md
    assert "layer 24's indexer" in _captions(at)
    frames = [d.value for d in at.dataframe]
    assert any("model" in f and list(f["model"]) == ["release", "live model"] for f in frames)   # the KV rows
    at.button(key="detail_btn").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    md = "\n".join(m.value for m in at.markdown)
    assert "mean selection recall" in md
    assert "Best unpicked: " in _captions(at)


@pytest.mark.skipif(not (Path(__file__).resolve().parents[1] / "assets" / "model" / "config.json").exists(),
                    reason="the shipped model is not in assets/model")
def test_side_by_side_aligns_tokens_before_comparing(monkeypatch):
    monkeypatch.setenv("EXPLORER_SOURCE", "shipped")
    at = _run({"layer": "24"}, timeout=300)
    text = at.text_area(key="prompt_text").value
    cut = text.index("\n") + 1
    edited = text[:cut] + "# a small edit\n" + text[cut:]      # a few tokens inserted near the start
    at.radio(key="cmp_mode").set_value("prompt").run()
    at.text_area(key="cmp_prompt").set_value(edited).run()
    at.button(key="cmp_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    md = "\n".join(m.value for m in at.markdown).replace("\\", "")      # md_escape's backslashes
    line = next(m for m in md.splitlines() if "Aligned by tokens" in m)
    assert "0 only in A" in line and "(1 edit)" in line and "inserted" in _captions(at)
    aligned = int(line.split("overlap ")[1].split("%")[0])
    naive = next(m for m in md.splitlines() if "mean overlap" in m and "Aligned" not in m)
    naive = int(naive.split("mean overlap ")[1].split("%")[0])
    print(line, "|", naive)
    # aligned, the picks overlap more than position by position (where every later position is shifted)
    assert aligned > naive
