"""Widget flows of app.py with Streamlit's AppTest (config-only source; no Plotly clicks here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from _fixtures_checkpoint import release_skeleton  # noqa: F401  (fixture)

APP = str(Path(__file__).resolve().parents[1] / "app.py")


@pytest.fixture(autouse=True)
def config_source(monkeypatch):
    monkeypatch.setenv("EXPLORER_SOURCE", "config")


def run(query: dict | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    for key, value in (query or {}).items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def markdown(at) -> str:
    return "\n".join(m.value for m in at.markdown)


def test_default_view_and_url():
    at = run()
    assert "## Layer 24 · Reindex" in markdown(at)
    assert at.query_params["layer"] == ["24"] or at.query_params["layer"] == "24"
    assert [s.value for s in at.subheader] == ["Top-k selections", "mHC coefficients", "Expert routing"]
    assert any("no weights are loaded" in i.value for i in at.info)
    assert not at.error


def test_url_restores_layer_and_tab():
    at = run({"layer": "2", "tab": "full_m2"})
    assert "## Layer 2 · Full m=2" in markdown(at)
    assert at.session_state["diagram_tab"] == "Full (m=2, encoder)"
    at = run({"layer": "29"})
    assert "## Layer 29 · Reuse" in markdown(at)
    assert any("layer 28 chose" in c.value for c in at.caption)


def test_bad_url_warns_and_falls_back():
    at = run({"layer": "77"})
    assert any("77" in w.value for w in at.warning)
    assert "## Layer 24 · Reindex" in markdown(at)


def test_tally_position_radio_updates_metric_and_url():
    at = run()
    assert at.metric[0].value == "763.2B"
    at.radio(key="tally_pos").set_value("decode").run()
    assert at.metric[0].value == "16.13B"
    assert dict(at.query_params)["pos"] in ("decode", ["decode"])
    at.radio(key="tally_pos").set_value("prefill").run()
    assert at.metric[0].value == "7.90B"


def test_sidebar_sample_and_image_span():
    at = run()
    at.sidebar.selectbox(key="sample").set_value("04_long_incident_review").run()
    assert "Incident review" in at.sidebar.text_area(key="prompt_text").value
    assert any("tokens" in c.value for c in at.sidebar.caption)
    at.sidebar.checkbox(key="image_on").check().run()
    at.sidebar.text_input(key="image_span").input("5-2").run()
    assert any("start < end" in e.value for e in at.sidebar.error)


def test_context_length_changes_kv_metrics():
    at = run()
    total = [m for m in at.metric if m.label == "Total cache"][0]
    assert total.value == "893 MB"
    at.select_slider(key="context_len").set_value(1000).run()
    total = [m for m in at.metric if m.label == "Total cache"][0]
    assert total.value == "3.59 MB"      # 890 x 1000 B + 40 x 128 x 528 B of windows


def _page_still_draws(at) -> None:
    assert [t.value for t in at.title] == ["DeepSeek-V4.1-Flash explorer"]
    assert "### Sessions" in "\n".join(m.value for m in at.sidebar.markdown)       # the sessions sidebar
    assert any(m.label == "Total cache" for m in at.metric)                         # the KV panel
    assert "### Layer plan" in markdown(at)


def test_missing_checkpoint_folder_is_named_next_to_the_field(monkeypatch):
    monkeypatch.setenv("EXPLORER_CHECKPOINT_ROOT", "/")
    at = run()
    at.sidebar.radio(key="source").set_value("path").run()
    at.sidebar.text_input(key="ckpt_path").input("/does/not/exist").run()
    assert not at.exception
    assert [e.value for e in at.sidebar.error] == ["No folder at /does/not/exist. The release config is shown "
                                                   "meanwhile."]
    assert not at.main.error
    _page_still_draws(at)


def test_checkpoint_field_is_confined_to_the_allowed_root(tmp_path, monkeypatch):
    """The app listens beyond localhost (Streamlit's default): paths outside EXPLORER_CHECKPOINT_ROOT are
    refused before they are read, and no message quotes a file's contents."""
    monkeypatch.setenv("EXPLORER_CHECKPOINT_ROOT", str(tmp_path))
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "config.json").write_text("root:x:0:0:secret line")
    at = run()
    at.sidebar.radio(key="source").set_value("path").run()
    for path in ("/etc/passwd", "/etc", str(tmp_path / ".." / "..")):
        at.sidebar.text_input(key="ckpt_path").input(path).run()
        (msg,) = [e.value for e in at.sidebar.error]
        assert "allowed roots" in msg and str(tmp_path) in msg and "JSON" not in msg
        _page_still_draws(at)
    at.sidebar.text_input(key="ckpt_path").input(str(tmp_path / "notjson")).run()
    (msg,) = [e.value for e in at.sidebar.error]
    assert "is not a model config" in msg and "secret" not in msg and "root:x" not in msg
    _page_still_draws(at)


def test_saved_run_renders_live_views(tmp_path, monkeypatch):
    """A saved run (RunResult.to_json shape) drives all three live sections without errors."""
    import json

    from explorer_synth import synthetic_layer, synthetic_run

    T = 40
    image = [10 <= t < 20 for t in range(T)]
    layers = {24: synthetic_layer(T, k=8, n_experts=384, image=image),
              20: synthetic_layer(T, role="full", k=8, n_experts=384, index_source=20, image=image)}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(synthetic_run(T, layers, image=image)))
    monkeypatch.setenv("EXPLORER_RUN_JSON", str(path))
    at = run()
    assert not at.error, [e.value for e in at.error]
    assert at.slider(key="query_pos").value == T - 1
    assert any("text tokens (bias) use" in c.value for c in at.caption)
    assert any("engine held" in c.value for c in at.caption)
    at.slider(key="query_pos").set_value(5).run()
    assert not at.exception and not at.error
    at = run({"layer": "25"})      # Reuse: shows layer 24's selection
    assert not at.error and any("layer 24 chose" in c.value for c in at.caption)


def test_release_skeleton_tallies_from_headers_and_refuses_a_cpu_run(release_skeleton, monkeypatch):
    """Pointed at the 510 GB layout: plan, diagram and tallies come from its headers; a live run is
    refused with the reason (hours on a CPU), not started."""
    monkeypatch.setenv("EXPLORER_SOURCE", "path")
    monkeypatch.setenv("EXPLORER_CHECKPOINT", str(release_skeleton))
    monkeypatch.delenv("EXPLORER_ENGINE_URL", raising=False)
    at = run({"layer": "24", "tab": "reindex"})
    text = markdown(at) + "\n".join(c.value for c in at.caption)
    assert "checkpoint headers" in text
    assert any("16.1 B parameters per token" in i.value and "EXPLORER_ENGINE_URL" in i.value
               for i in list(at.info) + list(at.warning) + list(at.error)), [i.value for i in at.info]


def test_cpu_run_refusal_threshold():
    from explorer.layer_views import cpu_run_refusal
    assert cpu_run_refusal(20.6e6, on_cpu=True) is None          # the shipped small model
    assert cpu_run_refusal(16.13e9, on_cpu=False) is None         # on GPUs
    assert "16.1 B" in cpu_run_refusal(16.13e9, on_cpu=True)


def _qp(at, key):
    value = at.query_params.get(key)
    return value[0] if isinstance(value, list) else value


def test_url_keeps_the_source_and_the_prompt(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_DRAFT_DIR", str(tmp_path))
    at = run()
    at.sidebar.text_area(key="prompt_text").input("Paris is").run()
    assert _qp(at, "source") == "config" and _qp(at, "prompt") == "Paris is"
    # opened elsewhere (another server default): the link's source and prompt win; a DSpark stage exists
    monkeypatch.setenv("EXPLORER_SOURCE", "shipped")
    again = run({k: _qp(at, k) for k in ("source", "prompt")} | {"layer": "41"})
    assert again.sidebar.radio(key="source").value == "config"
    assert again.sidebar.text_area(key="prompt_text").value == "Paris is"
    assert not any("is not a layer" in w.value for w in again.warning)
    assert "## DSpark stage 1 (mtp.1) · window-only draft block" in markdown(again)
    assert any(c.value.startswith("Drawn for DSpark stage 1 (mtp.1") for c in again.caption)
    # a long prompt travels as a server-side draft named by its hash
    long = "The quick brown fox. " * 1000
    at.sidebar.text_area(key="prompt_text").input(long).run()
    assert _qp(at, "prompt") is None and len(_qp(at, "draft")) == 20
    monkeypatch.setenv("EXPLORER_SOURCE", "config")
    reloaded = run({"draft": _qp(at, "draft")})
    assert reloaded.sidebar.text_area(key="prompt_text").value == long
    gone = run({"draft": "0" * 20})
    assert any("not on this server" in w.value for w in gone.sidebar.warning)


def test_prompt_box_sample_empty_prompt_and_run_button():
    at = run()
    sample = at.sidebar.selectbox(key="sample")
    assert sample.value != "custom"
    at.sidebar.text_area(key="prompt_text").input(at.sidebar.text_area(key="prompt_text").value + " edited").run()
    assert at.sidebar.selectbox(key="sample").value == "custom"        # no longer names the sample
    at.sidebar.selectbox(key="sample").set_value(sample.value).run()
    assert at.sidebar.selectbox(key="sample").value == sample.value
    at.sidebar.text_area(key="prompt_text").input("").run()
    captions = [c.value for c in at.sidebar.caption]
    assert any(c.startswith("**Empty prompt**") for c in captions) and not any("0 tokens" in c for c in captions)
    assert at.sidebar.button(key="run_btn").label == "Run"
