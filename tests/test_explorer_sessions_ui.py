"""The sessions UI: explorer/session_view.py's view models against hand-made runs and a real SQLite
store, and app.py's session flows under AppTest (save, open by link, unknown id, delete with a
confirmation, rename, duplicate, an unreachable database). No model is run here: a synthetic run
(EXPLORER_RUN_JSON) stands in; the browser test replays on a real checkpoint."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.config import load_config
from engine.roles import role_plan
from explorer import session_view as sv
from explorer.session_compare import compare_layer, replay_report
from explorer.sessions import EXPORT_FORMAT, SessionData, SessionNotFound, SessionStore, SessionSummary, parse_export
from explorer.state import ViewState
from explorer_synth import synthetic_layer, synthetic_run
from pg_fixture import pg_server_url, pg_url  # noqa: F401  (fixtures)

APP = str(Path(__file__).resolve().parents[1] / "app.py")
RELEASE = Path(__file__).resolve().parents[1] / "assets" / "configs" / "v41-flash.json"
T = 24


@pytest.fixture(scope="module")
def plan():
    return role_plan(load_config(RELEASE))


@pytest.fixture
def store(tmp_path):
    with SessionStore(f"sqlite:///{tmp_path / 'sessions.sqlite3'}") as s:
        yield s


def run_with(layers=(20, 24, 25), seed=0, T=T) -> dict:
    """A synthetic run probing `layers` (25 is a Reuse layer borrowing 24's top-k)."""
    roles = {20: "full", 24: "reindex", 25: "reuse"}
    return synthetic_run(T, {L: synthetic_layer(T, role=roles.get(L, "reuse"), k=4, n_experts=384,
                                                  index_source=24 if L >= 24 else 20, seed=seed + L)
                             for L in layers})


def session_data(plan, *, layer=25, run=None, prompt="the prompt", span=(2, 5), settings=None, **kw):
    view = ViewState(layer=layer, tab=plan[layer].tab, position="decode")
    values = dict(name="Reuse at 25", author="ana", notes="<b>hi</b>", view=view, role=plan[layer],
                  source_kind="config", model_source="/models/x", model_identity="abc123", engine_version="0.1.0",
                  prompt=prompt, span=span, settings=settings or {"query_pos": 7, "mhc_pos": 3, "context_len": 1000},
                  run=run if run is not None else run_with())
    values.update(kw)
    return sv.build_session_data(**values)


# -- pure: saving and opening -------------------------------------------------------------------

def test_looked_at_layers_by_role(plan):
    assert sv.looked_at_layers(plan[25]) == [24, 25]    # Reuse: its own probes + the borrowed top-k
    assert sv.looked_at_layers(plan[24]) == [24]        # Reindex picks its own
    assert sv.looked_at_layers(plan[0]) == [0]          # SWA-only


def test_build_keeps_only_the_layers_looked_at(plan):
    run = run_with((20, 24, 25))
    data = session_data(plan, run=run)
    assert sorted(data.probes["layers"]) == ["24", "25"]
    assert data.probes["layers"]["25"] == run["layers"]["25"]
    assert data.probes["tokens"] == run["tokens"]
    assert sorted(run["layers"]) == ["20", "24", "25"]       # the run itself is not changed
    assert (data.layer, data.tab, data.view["position"]) == (25, "reuse", "decode")
    assert data.spans == [{"prompt": 0, "start": 2, "end": 5, "label": "image"}]
    assert data.view["query_pos"] == 7 and data.view["context_len"] == 1000
    assert data.prompts == ["the prompt"] and data.model_identity == "abc123"


def test_saved_session_restores_view_widgets_and_probes(plan, store):
    saved = store.save(session_data(plan))
    loaded = store.load(saved.id)
    view, problems = sv.view_from_session(loaded, plan, loaded.id)
    assert view == ViewState(layer=25, tab="reuse", position="decode", session=saved.id) and not problems
    widgets = sv.widget_state(loaded)
    assert widgets == {"prompt_text": "the prompt", "image_on": True, "image_span": "2-5", "query_pos": 7,
                       "mhc_pos": 3, "context_len": 1000}
    # the stored probes stand in for a run of the same prompt and marks at that layer
    assert sv.stored_run(loaded, plan[25], "the prompt", (2, 5))["layers"].keys() == {"24", "25"}
    assert sv.stored_run(loaded, plan[24], "the prompt", (2, 5)) is not None
    assert sv.stored_run(loaded, plan[25], "another prompt", (2, 5)) is None
    assert sv.stored_run(loaded, plan[25], "the prompt", None) is None
    assert sv.stored_run(loaded, plan[26], "the prompt", (2, 5)) is None   # 26 was not probed
    assert sv.stored_run(None, plan[25], "the prompt", (2, 5)) is None


def test_side_by_side_prompt_b_is_saved_and_set_up_again(plan, store):
    saved = store.save(session_data(plan, prompt_b="prompt B text"))
    loaded = store.load(saved.id)
    assert loaded.prompts == ["the prompt", "prompt B text"]
    widgets = sv.widget_state(loaded)
    assert widgets["prompt_text"] == "the prompt"
    assert widgets["cmp_mode"] == "prompt" and widgets["cmp_prompt"] == "prompt B text"
    # the stored probes are still prompt A's; a blank prompt B is not saved
    assert sv.stored_run(loaded, plan[25], "the prompt", (2, 5)) is not None
    assert session_data(plan, prompt_b="   ").prompts == ["the prompt"]
    assert "cmp_prompt" not in sv.widget_state(session_data(plan))


def test_view_from_session_out_of_range_values(plan):
    data = session_data(plan)
    data.layer, data.tab, data.view = 77, "nonsense", {"position": "sideways", "query_pos": 10_000,
                                                        "context_len": 12345}
    view, problems = sv.view_from_session(data, plan)
    assert view == ViewState(layer=24, tab="reindex", position="total")
    assert len(problems) == 1 and "77" in problems[0] and "0..42" in problems[0]   # 40 layers + 3 DSpark stages
    widgets = sv.widget_state(data)
    assert "query_pos" not in widgets and "context_len" not in widgets   # outside the sliders' ranges


def test_spans_round_trip_and_bad_marks():
    assert sv.image_span(sv.span_marks((3, 9))) == (3, 9)
    assert sv.span_marks(None) == [] and sv.image_span([]) is None
    assert sv.image_span([{"prompt": 1, "start": 0, "end": 2}, {"start": "x", "end": 2},
                          {"prompt": 0, "start": 5, "end": 5}, {"prompt": 0, "start": 1, "end": 4}]) == (1, 4)


def test_share_link_and_export_filename():
    assert sv.share_link("http://host:8501/", "AbC_123-xyz") == "http://host:8501/?session=AbC_123-xyz"
    assert sv.share_link("", "AbC_123-xyz") == "/?session=AbC_123-xyz"
    assert sv.export_filename("Copy heads / layer 24!", "AbCdEfGhIj") == "Copy_heads___layer_24-AbCdEfGh.json"
    assert sv.export_filename("///") == "session.json"


def test_export_of_an_unsaved_analysis_imports(plan, store):
    data = session_data(plan)
    document = sv.export_document(data)
    assert json.loads(document)["format"] == EXPORT_FORMAT
    back = parse_export(document)
    assert back == data
    session, problem = sv.import_upload(store, "a.json", document.encode())
    assert problem is None and store.load(session.id).probes == data.probes


@pytest.mark.parametrize("content, expected", [
    (b"not json at all", "not valid JSON"),
    (b'{"format": "something-else"}', "not a session export of this app"),
    (b"\xff\xfe\x00", "not UTF-8"),
    (json.dumps({"format": EXPORT_FORMAT, "format_version": 1, "session": {"name": "x"}}).encode(), "lacks author"),
])
def test_bad_import_file_is_a_message_and_stores_nothing(store, content, expected):
    session, problem = sv.import_upload(store, "bad.json", content)
    assert session is None and problem.startswith("bad.json: ") and expected in problem
    assert "Nothing was imported" in problem
    assert store.count() == 0


def test_import_without_a_store_is_a_message():
    session, problem = sv.import_upload(None, "s.json", b"{}")
    assert session is None and "unavailable" in problem


def test_source_state():
    s = SessionData(name="n", author="a", model_source="/ckpt", view={"source": "path"})
    assert sv.source_state(s, lambda p: True) == ({"source": "path", "ckpt_path": "/ckpt"}, None)
    values, note = sv.source_state(s, lambda p: False)
    assert values == {} and "/ckpt" in note
    s.view = {"source": "config"}
    assert sv.source_state(s, lambda p: False) == ({"source": "config"}, None)
    s.view = {}
    assert sv.source_state(s, lambda p: True) == ({}, None)


# -- pure: listings and text ----------------------------------------------------------------------

def test_listing_labels_and_rows():
    now = datetime(2026, 1, 10, 12, 0, tzinfo=timezone.utc)
    s = SessionSummary(id="x" * 22, name="A long name " * 10, author="ana", layer=24, prompts=["def f():\n  return 1"],
                       model_source="", notes_preview="", created_at=now, updated_at=now - timedelta(minutes=5),
                       revision=1)
    label = sv.summary_label(s, now)
    assert label.endswith(" · ana · layer 24 · 5 min ago") and "…" in label
    assert sv.summary_rows([s], now) == [{"Name": s.name, "Author": "ana", "Layer": 24, "Prompt": "def f(): return 1",
                                          "Changed": "5 min ago"}]
    assert sv.when(now - timedelta(seconds=5), now) == "just now"
    assert sv.when(now - timedelta(hours=3), now) == "3 h ago"
    assert sv.when(now - timedelta(days=3), now) == "2026-01-07"
    assert sv.compare_choices([s], exclude=s.id) == {} and list(sv.compare_choices([s], None)) == [s.id]


def test_notes_keep_their_line_breaks_and_stay_inert():
    md = sv.notes_markdown("first line\nsecond *line*\n\nafter a blank\r\n")
    assert md.split("  \n") == ["first line", "second \\*line\\*", "&#8203;", "after a blank"]


def test_md_escape_makes_user_text_inert():
    assert sv.md_escape("<script>alert(1)</script>") == "\\<script\\>alert\\(1\\)\\</script\\>"
    assert sv.md_escape("**bold** [x](javascript:1) :red[x]") == \
        "\\*\\*bold\\*\\* \\[x\\]\\(javascript\\:1\\) \\:red\\[x\\]"
    assert sv.md_escape("plain words") == "plain words"


# -- pure: replay and side by side ----------------------------------------------------------------

def test_replay_view_identical_and_different():
    saved = run_with((24, 25))
    same = sv.replay_view(replay_report(saved, json.loads(json.dumps(saved))))
    assert same.identical and same.headline.startswith("Replay identical") and not same.lines
    # the tokens section counts positions (ids and texts of one position are one token): "tokens 12"
    assert f"tokens {len(saved['tokens'])}," in same.headline
    changed = json.loads(json.dumps(saved))
    changed["layers"]["25"]["routing"]["experts"][3] = [0, 1, 2, 3, 4, 5]
    old = set(saved["layers"]["25"]["routing"]["experts"][3])
    view = sv.replay_view(replay_report(saved, changed))
    assert not view.identical and "routing (1 of" in view.headline
    assert view.lines[0].startswith("routing: layer 25, position 3")
    assert str(sorted(old - {0, 1, 2, 3, 4, 5})[0]) in view.lines[0]


def test_identity_note(plan):
    data = session_data(plan)
    assert sv.identity_note(data, "abc123") is None
    assert "abc123" in sv.identity_note(data, "zzz") and "zzz" in sv.identity_note(data, "zzz")
    data.model_identity = ""
    assert "does not record" in sv.identity_note(data, "zzz")
    assert sv.replay_layers(data) == [24, 25]


def _two_runs():
    """Hand-made: 3 positions; position 1 differs in one selection, position 2 in one expert."""
    def run(topk, experts):
        layer = {"role": "reindex", "topk": topk, "routing": {"experts": experts, "weights": experts}}
        return {"tokens": ["<bos>", "a", "b"], "layers": {"24": layer}}
    a = run([[0, -1], [0, 1], [1, 2]], [[1, 2], [3, 4], [5, 6]])
    b = run([[0, -1], [0, 3], [2, 1]], [[2, 1], [3, 4], [5, 7]])
    return a, b


def test_comparison_rows_summary_and_figure():
    a, b = _two_runs()
    cmp = compare_layer(a, b, 24)
    rows = sv.comparison_rows(cmp, only_differences=True)
    assert [r["Pos"] for r in rows] == [1, 2]
    assert rows[0]["Selected only A"] == "1" and rows[0]["Selected only B"] == "3" and rows[0]["Selected both"] == 1
    assert rows[1]["Experts only A"] == "6" and rows[1]["Experts only B"] == "7" and rows[1]["Experts both"] == "5"
    assert rows[0]["Experts only A"] == "—"
    assert len(sv.comparison_rows(cmp)) == 3
    lines = sv.comparison_summary(cmp)
    assert "Selections differ at 1 of the 3 positions both runs have" in lines[1]
    assert "Routing differs at 1 of the 3" in lines[2] and len(lines) == 3
    fig = sv.comparison_figure(cmp, "routing")
    both, only_a, only_b = fig.data
    assert list(only_a.x) == [2] and list(only_a.y) == [6] and list(only_b.y) == [7]
    assert sorted(zip(both.x, both.y)) == [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5)]
    sel = sv.comparison_figure(cmp, "selections")
    assert len(sel.data[0].x) == 4 and list(sel.data[1].y) == [1] and list(sel.data[2].y) == [3]
    with pytest.raises(ValueError):
        sv.comparison_figure(cmp, "nope")


def test_summary_of_runs_of_different_lengths_counts_shared_positions_apart():
    """The new user's contradiction: "differ at 6869 of 7068 positions (mean overlap 100%)" when B
    is a short prompt equal to A's start. Now the count and the overlap speak of the same positions."""
    a = synthetic_run(40, {20: synthetic_layer(40, seed=3)})
    b = {"tokens": a["tokens"][:10], "layers": {"20": {k: (v[:10] if isinstance(v, list) else v)
                                                       for k, v in a["layers"]["20"].items()}}}
    b["layers"]["20"]["routing"] = {k: v[:10] for k, v in a["layers"]["20"]["routing"].items()}
    cmp = compare_layer(a, b, 20)
    lines = sv.comparison_summary(cmp)
    assert "Selections differ at 0 of the 10 positions both runs have (mean overlap 100%)." in lines
    assert "Routing differs at 0 of the 10 positions both runs have (mean overlap 100%)." in lines
    assert "Positions 10-39 are only in A (not compared)." in lines


def test_comparison_figure_uses_webgl_for_many_marks():
    T = 700   # 700 queries x 6 picks > 3000 marks
    a = synthetic_run(T, {20: synthetic_layer(T, k=6, seed=1)})
    b = synthetic_run(T, {20: synthetic_layer(T, k=6, seed=2)})
    fig = sv.comparison_figure(compare_layer(a, b, 20), "selections")
    assert {t.type for t in fig.data} == {"scattergl"}
    assert sum(len(t.x) for t in fig.data) > 3000
    small = sv.comparison_figure(compare_layer(*_two_runs(), 24), "selections")
    assert {t.type for t in small.data} == {"scatter"}


# -- AppTest: the app's session flows ---------------------------------------------------------------

@pytest.fixture
def app_env(tmp_path, monkeypatch):
    """Config source, a synthetic run on screen, a fresh SQLite session file."""
    run = run_with((20, 24, 25))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    monkeypatch.setenv("EXPLORER_SOURCE", "config")
    monkeypatch.setenv("EXPLORER_RUN_JSON", str(path))
    monkeypatch.setenv("EXPLORER_DB_PATH", str(tmp_path / "app.sqlite3"))
    monkeypatch.delenv("EXPLORER_DB_URL", raising=False)
    return {"run": run, "db": tmp_path / "app.sqlite3"}


def start(query=None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    for k, v in (query or {}).items():
        at.query_params[k] = v
    at.run()
    check(at)
    return at


def check(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


def headings(at) -> list[str]:
    return [m.value for m in at.markdown if m.value.startswith("## ")]


def save_via_sidebar(at, name="Reuse at 25", author="ana", notes="look *here*") -> str:
    at.sidebar.text_input(key="save_name").input(name)
    at.sidebar.text_input(key="save_author").input(author)
    at.sidebar.text_area(key="save_notes").input(notes)
    next(b for b in at.sidebar.button if b.label == "Save session").click()
    at.run()
    check(at)
    return at.session_state["view"].session


def query_value(at, key):
    value = dict(at.query_params).get(key)
    return value[-1] if isinstance(value, list) else value


def test_app_save_then_open_by_link(app_env, monkeypatch):
    at = start({"layer": "25"})
    sid = save_via_sidebar(at)
    assert sid and query_value(at, "session") == sid
    assert any("Saved session" in s.value for s in at.success)
    assert any(f"?session={sid}" in c.value for c in at.code)          # the share link
    with SessionStore.from_env() as s:
        stored = s.load(sid)
    assert sorted(stored.probes["layers"]) == ["24", "25"] and stored.layer == 25 and stored.notes == "look *here*"

    # a fresh visitor: no saved run on disk, config only -> the stored probes draw the views
    monkeypatch.delenv("EXPLORER_RUN_JSON")
    at2 = start({"session": sid})
    assert headings(at2) == ["## Layer 25 · Reuse"]
    assert at2.session_state["diagram_tab"].startswith("Reuse")
    assert [s.value for s in at2.subheader] == ["Top-k selections", "mHC coefficients", "Expert routing"]
    assert at2.slider(key="query_pos").max == T - 1                   # the top-k view is drawn from probes
    assert any("stored probes" in c.value for c in at2.caption)
    assert any(m.value == "**Session:** Reuse at 25" for m in at2.markdown)
    assert any(m.value == "look \\*here\\*" for m in at2.markdown)    # notes escaped, shown literally
    assert not at2.error and query_value(at2, "session") == sid


def test_app_saves_prompt_b_of_the_side_by_side(app_env, monkeypatch):
    at = start({"layer": "25"})
    at.radio(key="cmp_mode").set_value("prompt").run()
    at.text_area(key="cmp_prompt").input("what prompt B says").run()
    check(at)
    sid = save_via_sidebar(at)
    with SessionStore.from_env() as s:
        assert s.load(sid).prompts[1] == "what prompt B says"
    at2 = start({"session": sid})
    assert at2.radio(key="cmp_mode").value == "prompt"
    assert at2.text_area(key="cmp_prompt").value == "what prompt B says"


def test_build_keeps_the_serving_plan_inputs(plan):
    inputs = {"gpu": "b200", "gpus": 4, "ep": 4, "tp": 1, "dp_attention": True, "batch": 32, "context": 65536,
              "engram": "host"}
    assert session_data(plan, plan_settings={"plan": inputs}).view["plan"] == inputs
    assert "plan" not in session_data(plan, plan_settings={}).view      # nothing on screen, nothing stored


def test_app_saved_session_round_trips_the_plan_inputs(app_env):
    """The Serving plan's inputs as set in its widgets are saved with the session and come back in
    the widgets when the session is opened by its link."""
    at = start({"layer": "25", "plan_open": "true"})
    at.selectbox(key="plan_gpu").set_value("mi300x").run()
    at.number_input(key="plan_batch").set_value(96).run()
    at.checkbox(key="plan_dp").check().run()
    check(at)
    sid = save_via_sidebar(at)
    with SessionStore.from_env() as s:
        stored = s.load(sid).view["plan"]
    assert (stored["gpu"], stored["batch"], stored["dp_attention"]) == ("mi300x", 96, True)

    at2 = start({"session": sid, "plan_open": "true"})
    assert at2.selectbox(key="plan_gpu").value == "mi300x"
    assert at2.number_input(key="plan_batch").value == 96 and at2.checkbox(key="plan_dp").value is True
    assert query_value(at2, "plan_gpu") == "mi300x" and query_value(at2, "plan_batch") == "96"


def test_app_saves_the_links_plan_inputs_with_the_expander_closed(app_env):
    at = start({"layer": "25", "plan_gpu": "b200", "plan_batch": "32"})   # the expander was never opened
    sid = save_via_sidebar(at)
    with SessionStore.from_env() as s:
        stored = s.load(sid).view["plan"]
    assert (stored["gpu"], stored["batch"]) == ("b200", 32)


def test_app_sessions_on_postgresql(app_env, pg_url, monkeypatch):  # noqa: F811
    """The same flow with the team's database: EXPLORER_DB_URL names a PostgreSQL server."""
    monkeypatch.setenv("EXPLORER_DB_URL", pg_url)
    at = start({"layer": "25"})
    sid = save_via_sidebar(at, name="On the team database")
    with SessionStore(pg_url) as s:
        assert s.dialect == "postgresql" and s.load(sid).name == "On the team database"
    if app_env["db"].exists():        # nothing went to the SQLite file
        with SessionStore.from_env({"EXPLORER_DB_PATH": str(app_env["db"])}) as local:
            assert local.count() == 0
    monkeypatch.delenv("EXPLORER_RUN_JSON")
    at2 = start({"session": sid})
    assert headings(at2) == ["## Layer 25 · Reuse"] and query_value(at2, "session") == sid
    assert any(m.value == "**Session:** On the team database" for m in at2.markdown)


def test_app_unknown_session_keeps_the_default_view(app_env):
    at = start({"session": "doesNotExist_123"})
    assert any("No saved session has the id" in w.value for w in at.warning)
    assert headings(at) == ["## Layer 24 · Reindex"]
    assert query_value(at, "session") is None
    assert "open_session" not in at.session_state


def test_app_unreachable_database_offers_export(app_env, monkeypatch):
    monkeypatch.setenv("EXPLORER_DB_URL", "postgresql://127.0.0.1:1/x")
    at = start({"session": "AAAAAAAAAAAAAAAAAAAAAA"})
    assert any("Team sessions are unavailable" in e.value for e in at.sidebar.error)
    assert any("Cannot open the session" in e.value for e in at.error)
    assert headings(at) == ["## Layer 24 · Reindex"]          # the rest of the app still works
    assert at.slider(key="query_pos").max == T - 1
    labels = [b.label for b in at.sidebar.button]
    assert "Retry the database" in labels
    at.radio(key="tally_pos").set_value("decode").run()
    check(at)
    assert at.metric[0].value == "16.13B"


def test_the_unsaved_export_is_named_by_model_layer_and_prompt(app_env, monkeypatch):
    """Without a database the sidebar offers the analysis as JSON, named like the charts (issue 14)."""
    import hashlib

    from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
    names: list[str] = []
    load = MemoryMediaFileStorage.load_and_get_id

    def recorded(self, data, mimetype, kind, filename=None):
        names.append(filename)
        return load(self, data, mimetype, kind, filename)

    monkeypatch.setattr(MemoryMediaFileStorage, "load_and_get_id", recorded)
    monkeypatch.setenv("EXPLORER_DB_URL", "postgresql://127.0.0.1:1/x")
    at = start()
    text = at.text_area(key="prompt_text").value
    assert text.strip()
    h = hashlib.sha256(text.encode()).hexdigest()[:8]
    assert f"release-config_layer24_p{h}_analysis.json" in names, names


def test_app_delete_needs_confirmation_and_can_be_undone(app_env):
    at = start()
    sid = save_via_sidebar(at, name="To delete")
    at.button(key="delete_btn").click().run()
    check(at)
    assert any("for everyone" in w.value for w in at.warning)
    with SessionStore.from_env() as s:
        assert s.load(sid).name == "To delete"           # not deleted before "Yes"
    at.button(key="delete_no").click().run()
    assert not any("for everyone" in w.value for w in at.warning)
    at.button(key="delete_btn").click().run()
    at.button(key="delete_yes").click().run()
    check(at)
    with SessionStore.from_env() as s, pytest.raises(SessionNotFound, match="deleted"):
        s.load(sid)
    assert query_value(at, "session") is None and "open_session" not in at.session_state
    at.button(key="undo_delete").click().run()
    check(at)
    with SessionStore.from_env() as s:
        assert s.load(sid).name == "To delete"


def test_app_rename_notes_duplicate_and_search(app_env):
    at = start({"layer": "25"})
    sid = save_via_sidebar(at, name="First")
    at.text_input(key="edit_name").input("Renamed")
    at.text_area(key="edit_notes").input("new notes")
    at.button(key="edit_save").click().run()
    check(at)
    with SessionStore.from_env() as s:
        got = s.load(sid)
    assert (got.name, got.notes, got.revision) == ("Renamed", "new notes", 2)
    at.button(key="dup_btn").click().run()
    check(at)
    copy_id = at.session_state["open_session"].id
    assert copy_id != sid and at.session_state["open_session"].name == "Renamed (copy)"
    assert query_value(at, "session") == copy_id
    at.sidebar.text_input(key="session_query").input("layer:25 copy").run()
    check(at)
    assert at.sidebar.selectbox(key="session_pick").options == [sv.summary_label(s) for s in
                                                                SessionStore.from_env().list_sessions("copy")]
    at.sidebar.text_input(key="session_query").input("layer:3").run()
    assert any("No session matches" in c.value for c in at.sidebar.caption)


def test_app_replay_without_weights_says_so(app_env):
    at = start({"layer": "25"})
    save_via_sidebar(at)
    at.button(key="replay_btn").click().run()
    check(at)
    assert any("Replay needs model weights" in i.value for i in at.info)


def test_app_side_by_side_with_a_second_session(app_env, tmp_path, monkeypatch):
    at = start({"layer": "25"})
    first = save_via_sidebar(at, name="A run")
    other = run_with((24, 25), seed=5)
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    monkeypatch.setenv("EXPLORER_RUN_JSON", str(path))
    at2 = start({"layer": "25"})
    save_via_sidebar(at2, name="B run")
    assert not any("differs at" in m.value for m in at2.markdown)   # nothing is compared until asked
    at2.radio(key="cmp_mode").set_value("session").run()
    assert at2.selectbox(key="cmp_session").value is None
    assert not any("differs at" in m.value for m in at2.markdown)
    at2.selectbox(key="cmp_session").set_value(first).run()
    expected = compare_layer(other, app_env["run"], 25)
    assert any(m.value.startswith(f"- Routing differs at {len(expected.routing_diff_positions)} of the {T}")
               for m in at2.markdown), [m.value for m in at2.markdown]
