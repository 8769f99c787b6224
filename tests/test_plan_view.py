"""The Serving plan view model (explorer/planner_view.py): inputs through the URL and sessions, figures
valid for plotly, the largest-batch series, and the measured figures beside the prediction."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.config import release_config
from engine.plan import GPUS, PlanInputs, largest_batch, make_plan
from engine.tally import tally_from_config
from explorer import planner_view as pv


@pytest.fixture(scope="module")
def cfg():
    return release_config()


@pytest.fixture(scope="module")
def tally(cfg):
    return tally_from_config(cfg)


INPUTS = PlanInputs(gpu="mi300x", gpus=8, ep=4, tp=2, dp_attention=True, batch=96, context=300_000, engram="host")


def test_inputs_round_trip_through_the_url_and_a_session(cfg):
    query = pv.inputs_to_query(INPUTS)
    assert query["plan_dp"] == "1" and query["plan_ctx"] == "300000"
    back, problems = pv.inputs_from_mapping(query, cfg, pv.URL_KEYS)
    assert back == INPUTS and problems == []
    stored = json.loads(json.dumps(pv.session_settings(INPUTS)))       # what a session's view dict keeps
    assert pv.inputs_from_session(stored, cfg) == (INPUTS, [])
    assert pv.inputs_from_session({"position": "total"}, cfg) is None


def test_bad_url_values_fall_back_with_a_message(cfg):
    query = {"plan_gpu": "a100", "plan_tp": "3", "plan_ctx": "12.5", "plan_batch": ["4", "32"], "plan_dp": "maybe",
             "plan_engram": "HOST", "plan_gpus": "5000"}
    got, problems = pv.inputs_from_mapping(query, cfg, pv.URL_KEYS)
    d = pv.DEFAULT_INPUTS
    assert (got.gpu, got.tp, got.context, got.dp_attention) == (d.gpu, d.tp, d.context, d.dp_attention)
    assert got.batch == 32 and got.engram == "host"     # the last of repeated values; case folded
    assert got.gpus == d.gpus
    text = " ".join(problems)
    assert "plan_gpu='a100' is not usable (unknown GPU 'a100'" in text
    assert "plan_tp='3' is not usable (tp=3 does not divide gpus=8)" in text
    assert "plan_ctx='12.5' is not usable" in text and "plan_dp='maybe'" in text
    assert "plan_gpus='5000' is not usable (gpus must be a whole number from 1 to 4,096" in text


def test_divisor_choices(cfg):
    assert pv.tp_choices(cfg, 8) == [1, 2, 4, 8] and pv.ep_choices(cfg, 8) == [1, 2, 4, 8]
    assert pv.tp_choices(cfg, 6) == [1, 2] and pv.ep_choices(cfg, 6) == [1, 2, 3, 6]


def test_bytes_bar_adds_up_to_hbm(cfg, tally):
    plan = make_plan(cfg, INPUTS, tally)
    assert plan.memory.fits
    segments = pv.memory_segments(plan)
    assert sum(b for _, _, b in segments) == pytest.approx(plan.memory.hbm)
    assert {name for _, name, _ in segments} >= {"routed experts", "global KV", "index keys", "free"}
    fig = pv.memory_figure(plan)
    fig.validated()
    assert sum(t.x[0] for t in fig.data) == pytest.approx(plan.memory.hbm / 1e9)
    over = make_plan(cfg, replace(INPUTS, gpu="h100", batch=4000), tally)
    assert not over.memory.fits and pv.memory_segments(over)[-1][2] == 0
    assert sum(t.x[0] for t in pv.memory_figure(over).data) == pytest.approx(over.memory.used / 1e9)


def test_roofline_rows_cover_every_layer(cfg, tally):
    plan = make_plan(cfg, INPUTS, tally)
    rows = pv.roofline_rows(plan.decode)
    assert rows[0]["role"] == "SWA-only" and rows[-1]["role"] == "embedding + head"
    assert sum(float(r["share of step"].rstrip("%")) for r in rows) == pytest.approx(100, abs=len(rows))
    assert pv._ranges([3, 4, 5, 7, 9, 10]) == "3-5, 7, 9-10"
    layers = [x for r in plan.decode.rows for x in r.layers]
    assert sorted(layers) == list(range(40))


def test_largest_batch_series(cfg, tally):
    series = pv.batch_series(cfg, tally, INPUTS)
    xs = series["context"]
    assert xs[0] == 1024 and xs[-1] == 1_048_576
    for key in GPUS:
        ys = series[key]
        assert all(a >= b for a, b in zip(ys, ys[1:])), key      # longer context, never a larger batch
    # more HBM, same layout: never a smaller batch
    assert all(b2 >= h2 >= h1 for b2, h2, h1 in zip(series["b200"], series["h200"], series["h100"]))
    i = xs.index(min(xs, key=lambda x: abs(x - 65536)))
    assert series["h200"][i] == largest_batch(cfg, tally, replace(INPUTS, gpu="h200"), xs[i])
    pv.batch_figure(series, INPUTS).validated()


def test_bench_runs_beside_the_plan(cfg):
    """benches/results holds release-size layers run on 2 H200s: the weights each GPU held equal the plan's
    to the byte, and every measured layer time sits above its roofline bound."""
    runs = pv.bench_runs()
    if not runs:
        pytest.skip("no release-size run in benches/results")
    for run in runs:
        m = pv.measured_vs_predicted(cfg, run)
        assert m["measured_weights"] == m["predicted_weights"], run["file"]
        assert len(m["rows"]) == m["n_layers"]
        for row in m["rows"]:
            assert 0 < row["predicted ms"] < row["measured ms"]
            assert row["GFLOP (plan)"] == pytest.approx(row["GFLOP (bench)"], rel=0.05)


def test_live_run_cache_equals_the_plan():
    """The shipped small model's own cache count after a prompt (global KV, windows, pending compressor
    tokens) equals the plan's one sequence at that length."""
    import engine.run.api as api
    eng = api.load()
    run = eng.run("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # odd length?", layers=[]).to_json()
    got = pv.live_cache(eng.cfg, run)
    assert got["tokens"] == len(run["tokens"]) and got["match"]
    assert {r["cache"]: r["plan (bytes)"] for r in got["rows"]}["total"] == run["cache_bytes"]["total"]
    assert pv.live_cache(eng.cfg, None) is None


def test_app_draws_the_plan_from_the_url(monkeypatch):
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv("EXPLORER_SOURCE", "config")
    at = AppTest.from_file(str(pv.RESULTS_DIR.parents[1] / "app.py"), default_timeout=120)
    for key, value in {"plan_open": "true", **pv.inputs_to_query(replace(INPUTS, gpu="b200"))}.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception and not at.error
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Fits"].endswith("/ 180 GB")
    assert {n.label: n.value for n in at.number_input} == {"GPUs": 8, "Batch": 96, "Context (tokens)": 300_000}
    assert dict(at.query_params)["plan_engram"] in ("host", ["host"])


def test_app_restores_the_plan_a_session_saved(monkeypatch, tmp_path, cfg):
    """A session whose view dict holds {"plan": ...} opens with those inputs in the Serving plan."""
    from streamlit.testing.v1 import AppTest

    from engine.roles import role_plan
    from explorer import session_view as sv
    from explorer.sessions.store import SessionStore
    from explorer.state import ViewState
    db = tmp_path / "sessions.sqlite3"
    monkeypatch.setenv("EXPLORER_SOURCE", "config")
    monkeypatch.setenv("EXPLORER_DB_PATH", str(db))
    monkeypatch.delenv("EXPLORER_DB_URL", raising=False)
    data = sv.build_session_data(name="plan", author="t", notes="", view=ViewState(), role=role_plan(cfg)[24],
                                 source_kind="config", model_source="config", model_identity="", engine_version="",
                                 prompt="x", span=None)
    data.view.update(pv.session_settings(INPUTS))
    saved = SessionStore.from_env({"EXPLORER_DB_PATH": str(db)}).save(data)
    at = AppTest.from_file(str(pv.RESULTS_DIR.parents[1] / "app.py"), default_timeout=120)
    at.query_params["session"] = saved.id
    at.query_params["plan_open"] = "true"
    at.run()
    assert not at.exception and not at.error
    assert {n.label: n.value for n in at.number_input} == {"GPUs": 8, "Batch": 96, "Context (tokens)": 300_000}
    assert {s.label: s.value for s in at.selectbox}["GPU"] == "mi300x"
