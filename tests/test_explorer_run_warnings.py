"""What the app says about numbers it cannot trust: NaN/inf in a run (explorer/run_warnings.py, checked
against a real engine run on a checkpoint holding NaN and inf weights) and session rows the store
skipped as damaged (session_view.damaged_sessions_warning, against a real SQLite store); then both
in the app under AppTest."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa
from streamlit.testing.v1 import AppTest

from engine.run.api import load
from engine.checkpoint.writer import write_checkpoint
from engine.checkpoint.weights import random_weights
from explorer import run_warnings as rw, session_view as sv
from explorer.screens.live import nonfinite_weights
from explorer.sessions import SessionData, SessionStore
from explorer_synth import synthetic_layer, synthetic_run
from tests.engine_helpers import tiny_config

APP = str(Path(__file__).resolve().parents[1] / "app.py")
T = 24


# -- NaN / inf in a run ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """A real engine run whose checkpoint has a NaN weight in layer 1 and an inf one in layer 2."""
    folder = tmp_path_factory.mktemp("nan_ckpt")
    cfg = tiny_config(engram_layer_ids=(), engram_num_embeddings=())
    weights = random_weights(cfg, 0)
    weights["layers.1.attn_norm.weight"].fill_(float("nan"))
    weights["layers.2.ffn_norm.weight"].fill_(float("inf"))
    write_checkpoint(cfg, folder, tensors=weights, n_shards=1)
    engine = load(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run = engine.run([0] + list(range(20, 30)), layers=[0, 1, 2]).to_json()
    return json.loads(json.dumps(run)), nonfinite_weights(engine)   # through JSON, as a saved run comes back


def test_a_nan_run_is_reported_at_the_layers_it_reaches(nan_run):
    run, bad_weights = nan_run
    assert sorted(bad_weights) == ["layers.1.attn_norm.weight", "layers.2.ffn_norm.weight"]
    assert rw.nonfinite_counts(run["layers"]["0"]) == {}                 # before the NaN weight: clean
    counts = rw.nonfinite_counts(run["layers"]["2"])
    bad, n = counts["residual_norms"]
    assert n == 11 * len(run["layers"]["2"]["residual_norms"][0]) and bad == n   # every token's every copy
    text = rw.nonfinite_warning(run["layers"]["2"], 2, bad_weights)
    assert f"residual_norms: {bad} of {n}" in text and "layer 2" in text
    assert "'layers.1.attn_norm.weight'" in text and "'layers.2.ffn_norm.weight'" in text


def test_a_finite_run_has_no_warning():
    probe = synthetic_layer(T)
    assert rw.nonfinite_counts(probe) == {} and rw.nonfinite_warning(probe, 24) is None
    assert rw.nonfinite_warning(None, 24) is None


def test_the_warning_counts_each_array_and_caps_the_named_weights():
    probe = synthetic_layer(T, hc=4)
    probe["residual_norms"][3][1] = float("inf")
    probe["mhc"]["ffn"]["pre"][0] = [float("nan")] * 4
    assert rw.nonfinite_counts(probe) == {"residual_norms": (1, T * 4), "mHC FFN weights": (4, T * 4)}
    text = rw.nonfinite_warning({}, 5, [f"w{i}" for i in range(5)])
    assert "'w0', 'w1', 'w2' and 2 more" in text and "layer 5" not in text   # the weights alone


def test_ragged_probes_are_left_to_the_views():
    assert rw.nonfinite_counts({"residual_norms": [[1.0, 2.0], [3.0]]}) == {}


# -- damaged session rows -------------------------------------------------------------------------

def data(name: str) -> SessionData:
    return SessionData(name=name, author="t", notes="", model_source="config", model_identity="", engine_version="",
                       prompts=["p"], spans=[], layer=24, tab="reindex", view={"position": "total"}, probes=None)


def damage(store: SessionStore, session_id: str, column: str, value: str) -> None:
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE explorer_sessions SET {column} = :v WHERE id = :i"),
                     {"v": value, "i": session_id})


def test_damaged_rows_are_named_with_their_reason(tmp_path):
    with SessionStore(f"sqlite:///{tmp_path / 's.sqlite3'}") as store:
        store.save(data("good"))
        bad = [store.save(data(f"bad{i}")) for i in range(4)]
        damage(store, bad[0].id, "state_json", "{not json")
        assert sv.damaged_sessions_warning(store.list_sessions().damaged).startswith("1 stored session is damaged")
        for b in bad[1:]:
            damage(store, b.id, "created_at", "yesterday")
        found = store.list_sessions()
    text = sv.damaged_sessions_warning(found.damaged)
    assert text.startswith("4 stored sessions are damaged and not listed") and "and 1 more" in text
    assert sum(b.id in text for b in bad) == 3
    assert all(d.reason in text for d in found.damaged[:3])
    assert sv.damaged_sessions_warning([]) is None


# -- in the app -----------------------------------------------------------------------------------

@pytest.fixture
def app_env(tmp_path, monkeypatch):
    run = synthetic_run(T, {L: synthetic_layer(T, role="reindex" if L == 24 else "reuse", k=4, n_experts=384,
                                               index_source=24, seed=L) for L in (24, 25)})
    run["layers"]["25"]["residual_norms"][5] = [float("nan")] * 4
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    monkeypatch.setenv("EXPLORER_SOURCE", "config")
    monkeypatch.setenv("EXPLORER_RUN_JSON", str(path))
    monkeypatch.setenv("EXPLORER_DB_PATH", str(tmp_path / "app.sqlite3"))
    monkeypatch.delenv("EXPLORER_DB_URL", raising=False)
    return tmp_path / "app.sqlite3"


def start(query: dict) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    for k, v in query.items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_app_warns_beside_the_live_view_of_a_nan_layer(app_env):
    nan = [w.value for w in start({"layer": "25"}).warning if "NaN" in w.value]
    assert len(nan) == 1 and "layer 25 (residual_norms: 4 of 96)" in nan[0]
    assert not [w.value for w in start({"layer": "24"}).warning if "NaN" in w.value]


def test_app_sidebar_says_how_many_sessions_were_skipped(app_env):
    with SessionStore(f"sqlite:///{app_env}") as store:
        store.save(data("good"))
        bad = store.save(data("bad"))
        damage(store, bad.id, "state_json", "[1, 2]")
    at = start({"layer": "24"})
    shown = [w.value for w in at.sidebar.warning]
    assert len(shown) == 1 and shown[0].startswith("1 stored session is damaged")
    assert sv.md_escape(bad.id) in shown[0] and "not a JSON object" in shown[0]   # markdown-escaped: user data
    assert "good" in [o for o in at.sidebar.selectbox(key="session_pick").options][0]
