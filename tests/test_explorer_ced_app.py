"""The app's serving-prefill note and switch on a decoder layer (AppTest): the note on decoder layers
only, the switch's refusal without a live run, and a live comparison on the shipped model."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")
NOTE = "does not run on prompt tokens"


def _run(query: dict) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    for key, value in query.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _captions(at) -> list[str]:
    return [c.value for c in at.caption]


def test_the_note_is_on_decoder_layers_only(monkeypatch):
    monkeypatch.setenv("EXPLORER_SOURCE", "config")
    at = _run({"layer": "24"})
    assert any(NOTE in c and "teacher-forced" in c for c in _captions(at))
    at.toggle(key="ced_switch").set_value(True).run()
    assert any("Needs a live run of this prompt" in c for c in _captions(at))
    at = _run({"layer": "14"})
    assert not any(NOTE in c for c in _captions(at))
    assert not [t for t in at.toggle if t.key == "ced_switch"]


@pytest.mark.skipif(not (ROOT / "assets" / "model" / "config.json").exists(), reason="no shipped model")
def test_the_switch_compares_the_two_prefills_on_a_live_run(monkeypatch):
    monkeypatch.setenv("EXPLORER_SOURCE", "path")
    monkeypatch.setenv("EXPLORER_CHECKPOINT", str(ROOT / "assets" / "model"))
    monkeypatch.delenv("EXPLORER_ENGINE_URL", raising=False)
    monkeypatch.delenv("EXPLORER_RUN_JSON", raising=False)
    at = _run({"layer": "26"})
    at.sidebar.text_area(key="prompt_text").input("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n").run()
    at.toggle(key="ced_switch").set_value(True).run()
    assert not at.error, [e.value for e in at.error]
    labels = {m.label: m.value for m in at.metric}
    assert labels["Full prefill"].endswith(" s") and "CED prefill (R=32)" in labels
    # R=32 covers this short prompt: the CED prefill is the full one, so every pick agrees
    assert labels["Top-k Jaccard"] == "1.000" and labels["Routing agreement"] == "1.000"
    assert labels["Greedy continuations part at"] == "never"
    at.number_input(key="ced_replay").set_value(2).run()
    labels = {m.label: m.value for m in at.metric}
    assert "CED prefill (R=2)" in labels and not at.error


# -- how the run was computed: numerics and prefill captions over the live views ---------------------

def _loaded_run(tmp_path, monkeypatch, **fields) -> None:
    """A saved run (RunResult.to_json shape, EXPLORER_RUN_JSON) with these top-level fields."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from explorer_synth import synthetic_layer, synthetic_run

    T = 12
    run = synthetic_run(T, {24: synthetic_layer(T), 14: synthetic_layer(T, role="full", kv_source=14,
                                                                         index_source=14)})
    run.update(fields)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    monkeypatch.setenv("EXPLORER_SOURCE", "config")
    monkeypatch.setenv("EXPLORER_RUN_JSON", str(path))


def test_a_loaded_ced_run_says_its_prefill_and_replay(tmp_path, monkeypatch):
    _loaded_run(tmp_path, monkeypatch, numerics="reference", prefill="ced", replay=4)
    captions = _captions(_run({"layer": "14"}))
    assert "Numerics: reference (the official reference's bf16 dtype flow)" in captions
    assert any(c.startswith("Prefill: ced, replay 4:") and "last 4 of the 12 prompt tokens" in c for c in captions), captions
    _loaded_run(tmp_path, monkeypatch, numerics="fp32", prefill="ced", replay=32)
    captions = _captions(_run({"layer": "24"}))
    assert "Numerics: fp32 (float32 between ops)" in captions
    assert any(c.startswith("Prefill: ced, replay 32:") and "same as the full prefill" in c for c in captions), captions


def test_a_full_prefill_run_has_no_prefill_caption_and_an_old_run_says_fp32(tmp_path, monkeypatch):
    _loaded_run(tmp_path, monkeypatch, numerics="reference", prefill="full", replay=None)
    captions = _captions(_run({"layer": "24"}))
    assert "Numerics: reference (the official reference's bf16 dtype flow)" in captions
    assert not any(c.startswith("Prefill:") for c in captions)
    _loaded_run(tmp_path, monkeypatch)   # stored before runs named their numerics: the fp32 flow
    captions = _captions(_run({"layer": "24"}))
    assert any(c.startswith("Numerics: fp32") and "stored before" in c for c in captions), captions
