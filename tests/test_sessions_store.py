"""Session store against a real SQLite file and a real PostgreSQL server: save, load, list, search,
update, delete, duplicate, export/import, and clear errors that change nothing."""

from __future__ import annotations

import json
import re
import zlib

import pytest
import sqlalchemy as sa

from explorer.sessions import (
    EXPORT_FORMAT,
    SCHEMA_VERSION,
    InvalidSessionData,
    InvalidSessionFile,
    SessionConflict,
    SessionData,
    SessionNotFound,
    SessionStore,
    StoreUnavailable,
    model_identity,
    parse_export,
)
from pg_fixture import db_url, pg_server_url, pg_url, sqlite_url  # noqa: F401  (fixtures)


def probe_result(n_tokens: int = 5, seed: int = 0) -> dict:
    """A small result shaped like the engine's RunResult.to_json()."""
    layers = {}
    for layer in (20, 24):
        layers[str(layer)] = {
            "role": "reindex" if layer == 24 else "index",
            "kv_source": 20,
            "index_source": layer,
            "topk": [[(q * 7 + k + seed) % (q + 1) for k in range(min(q + 1, 4))] for q in range(n_tokens)],
            "candidate_pool": None,
            "mhc": {
                part: {
                    "pre": [[0.25 + 0.01 * q] * 4 for q in range(n_tokens)],
                    "post": [[1.0 / (q + 1)] * 4 for q in range(n_tokens)],
                    "comb": [[[0.25] * 4 for _ in range(4)] for _ in range(n_tokens)],
                }
                for part in ("attn", "ffn")
            },
            "routing": {
                "experts": [[(q * 11 + j * 5 + seed) % 384 for j in range(6)] for q in range(n_tokens)],
                "weights": [[1 / 6] * 6 for _ in range(n_tokens)],
            },
        }
    return {"tokens": [f"t{i}" for i in range(n_tokens)], "token_ids": list(range(100, 100 + n_tokens)), "layers": layers}


def sample(**overrides) -> SessionData:
    values = dict(
        name="Copy heads at layer 24",
        author="ana",
        notes="First look.\n<script>alert(1)</script>",
        model_source="/models/v41-flash",
        model_identity=model_identity({"dim": 4096}, {"weight_map": {"a": "f1"}}),
        engine_version="0.1.0",
        prompts=["The capital of France is", "Paris est la capitale"],
        spans=[{"prompt": 0, "start": 1, "end": 3, "label": "subject"}],
        layer=24,
        tab="routing",
        view={"heatmap": "log", "top_n": 8},
        probes=probe_result(),
    )
    values.update(overrides)
    return SessionData(**values)


@pytest.fixture
def store(db_url):  # noqa: F811
    with SessionStore(db_url) as s:
        yield s


def test_save_load_round_trip_keeps_every_field(store):
    data = sample(name="Robert'); DROP TABLE explorer_sessions;-- ✓ 日本", author='o"brien %_')
    saved = store.save(data)
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", saved.id)
    assert saved.revision == 1 and saved.created_at == saved.updated_at

    loaded = store.load(saved.id)
    for field in ("name", "author", "notes", "model_source", "model_identity", "engine_version",
                  "prompts", "spans", "layer", "tab", "view", "probes"):
        assert getattr(loaded, field) == getattr(data, field), field
    assert loaded.created_at == saved.created_at
    assert store.count() == 1  # the injection attempt is just a name


def test_probes_are_stored_compressed(store):
    probes = probe_result(n_tokens=64)
    saved = store.save(sample(probes=probes))
    with store.engine.connect() as conn:
        blob = conn.execute(sa.text("SELECT probes FROM explorer_sessions WHERE id = :i"), {"i": saved.id}).scalar_one()
    raw = json.dumps(probes).encode()
    assert len(bytes(blob)) < len(raw) / 4
    assert json.loads(zlib.decompress(bytes(blob))) == probes


def test_session_without_probes(store):
    saved = store.save(sample(probes=None, prompts=[], layer=None, tab=None))
    loaded = store.load(saved.id)
    assert loaded.probes is None and loaded.layer is None and loaded.prompts == []


def test_ids_are_unique_and_url_safe(store):
    ids = {store.save(sample(name=f"s{i}", probes=None)).id for i in range(20)}
    assert len(ids) == 20
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", i) for i in ids)


def test_list_and_search(store):
    a = store.save(sample(name="Induction heads", author="ana", layer=24, prompts=["The cat sat on the mat"], probes=None))
    b = store.save(sample(name="Routing drift", author="Bo", layer=12, prompts=["Quantum chromodynamics"], probes=None))
    c = store.save(sample(name="100% sparse", author="cy", layer=24, prompts=["mat cat"], notes="see the MAT token", probes=None))
    d = store.save(sample(name="1000 sparse", author="cy", layer=3, prompts=["zzz"], probes=None))

    newest_first = [s.id for s in store.list_sessions()]
    assert newest_first == [d.id, c.id, b.id, a.id]

    def ids(*args, **kw):
        return {s.id for s in store.list_sessions(*args, **kw)}

    assert ids("induction") == {a.id}                 # name, case-insensitive
    assert ids("BO") == {b.id}                        # author
    assert ids("chromodynamics") == {b.id}            # prompt text
    assert ids("cat") == {a.id, c.id}                 # prompt text in two sessions
    assert ids("cat mat") == {a.id, c.id}             # every word must match
    assert ids("cat routing") == set()
    assert ids("100%") == {c.id}                      # % is literal, not a wildcard
    assert ids("1_0") == set()                        # _ is literal too
    assert ids(layer=24) == {a.id, c.id}
    assert ids("sparse", layer=24) == {c.id}
    assert ids("layer:24") == {a.id, c.id}           # one search box: layer:N filters by layer
    assert ids("Layer=24 cat") == {a.id, c.id}
    assert ids("layer:3 sparse") == {d.id}
    assert ids(author="cy") == {c.id, d.id}
    assert ids(author="CY") == set()                  # author filter is exact
    assert [s.id for s in store.list_sessions(limit=2)] == [d.id, c.id]
    assert [s.id for s in store.list_sessions(limit=2, offset=2)] == [b.id, a.id]

    summary = store.list_sessions("induction")[0]
    assert summary.prompts == ["The cat sat on the mat"] and summary.layer == 24 and summary.author == "ana"


def test_update_rename_notes_and_revisions(store):
    saved = store.save(sample())
    renamed = store.rename(saved.id, "  Better name  ", expected_revision=1)
    assert renamed.name == "Better name" and renamed.revision == 2
    noted = store.set_notes(renamed.id, "new notes", expected_revision=2)
    assert noted.notes == "new notes" and noted.revision == 3
    assert noted.probes == saved.probes  # untouched fields survive
    assert noted.created_at == saved.created_at and noted.updated_at >= saved.updated_at

    moved = store.update(saved.id, layer=12, tab="mhc", prompts=["only one"], view={"x": 1})
    assert (moved.layer, moved.tab, moved.prompts, moved.view) == (12, "mhc", ["only one"], {"x": 1})
    assert {s.id for s in store.list_sessions(layer=12)} == {saved.id}
    assert {s.id for s in store.list_sessions("one")} == {saved.id}
    assert store.list_sessions("France") == []  # search follows the new prompts
    assert store.update(saved.id, probes={"tokens": ["z"], "layers": {}}).probes == {"tokens": ["z"], "layers": {}}
    assert store.load(saved.id).view == {"x": 1}

    with pytest.raises(SessionConflict) as err:
        store.set_notes(saved.id, "stale edit", expected_revision=2)  # now at revision 5
    assert "changed by someone else" in str(err.value)
    assert store.load(saved.id).notes == "new notes"  # the stale edit did not land


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"name": "   "}, "must not be empty"),
        ({"name": "x" * 201}, "too long"),
        ({"layer": -1}, "non-negative"),
        ({"layer": "24"}, "non-negative"),
        ({"prompts": "not a list"}, "list of texts"),
        ({"probes": [1, 2]}, "must be an object"),
        ({"view": {"f": object()}}, "not JSON"),
        ({"colour": "red"}, "Unknown session field"),
    ],
)
def test_bad_updates_are_refused_and_change_nothing(store, changes, message):
    saved = store.save(sample())
    with pytest.raises(InvalidSessionData, match=message):
        store.update(saved.id, **changes)
    again = store.load(saved.id)
    assert again.revision == 1 and again.name == saved.name


def test_delete_restore_purge(store):
    keep = store.save(sample(name="keep", probes=None))
    gone = store.save(sample(name="gone", probes=None))
    store.delete(gone.id)
    with pytest.raises(SessionNotFound, match="was deleted") as err:
        store.load(gone.id)
    assert err.value.deleted
    assert [s.id for s in store.list_sessions()] == [keep.id]
    with pytest.raises(SessionNotFound):
        store.update(gone.id, notes="x")

    assert store.restore(gone.id).name == "gone"
    assert store.count() == 2
    store.purge(gone.id)
    with pytest.raises(SessionNotFound) as err:
        store.load(gone.id)
    assert not err.value.deleted
    assert store.load(keep.id).name == "keep"


@pytest.mark.parametrize("bad_id", ["AAAAAAAAAAAAAAAAAAAAAA", "' OR '1'='1", "../../etc/passwd", "", "x" * 500])
def test_unknown_or_malformed_id_is_a_clear_not_found(store, bad_id):
    store.save(sample(probes=None))
    with pytest.raises(SessionNotFound, match="No saved session"):
        store.load(bad_id)
    with pytest.raises(SessionNotFound):
        store.delete(bad_id)
    assert store.count() == 1


def test_duplicate(store):
    saved = store.save(sample())
    copy = store.duplicate(saved.id, author="bo")
    assert copy.id != saved.id
    assert copy.name == saved.name + " (copy)" and copy.author == "bo"
    assert copy.probes == saved.probes and copy.prompts == saved.prompts
    store.rename(copy.id, "fork")
    assert store.load(saved.id).name == saved.name  # independent rows


def test_export_import_round_trip(store):
    saved = store.save(sample())
    text = store.export_json(saved.id)
    doc = json.loads(text)
    assert doc["format"] == EXPORT_FORMAT and doc["format_version"] == 1
    assert doc["session"]["id"] == saved.id

    imported = store.import_json(text.encode("utf-8"))
    assert imported.id != saved.id
    for field in ("name", "author", "notes", "prompts", "spans", "layer", "tab", "view", "probes", "model_identity"):
        assert getattr(imported, field) == getattr(saved, field), field
    assert store.count() == 2
    assert store.import_json(doc, author="cy").author == "cy"


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfe\x00garbage", "not UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2, 3]", "does not hold a JSON object"),
        (b'{"name": "x", "author": "y"}', "not a session export"),
        (b'{"format": "something-else", "format_version": 1, "session": {}}', "not a session export"),
        (json.dumps({"format": EXPORT_FORMAT, "format_version": 99, "session": {}}).encode(), "newer version"),
        (json.dumps({"format": EXPORT_FORMAT, "format_version": "1", "session": {}}).encode(), "format_version"),
        (json.dumps({"format": EXPORT_FORMAT, "format_version": 1}).encode(), 'no "session"'),
        (json.dumps({"format": EXPORT_FORMAT, "format_version": 1, "session": {"name": "x"}}).encode(), "lacks author"),
        (
            json.dumps({"format": EXPORT_FORMAT, "format_version": 1,
                        "session": {"name": "x", "author": "y", "layer": "deep"}}).encode(),
            "damaged",
        ),
    ],
)
def test_import_rejects_files_that_are_not_sessions(store, content, message):
    store.save(sample(probes=None))
    with pytest.raises(InvalidSessionFile, match=message):
        store.import_json(content)
    assert store.count() == 1  # nothing added, nothing lost


def test_parse_export_needs_no_database():
    doc = {"format": EXPORT_FORMAT, "format_version": 1, "session": {"name": "n", "author": "a", "layer": 3}}
    data = parse_export(json.dumps(doc))
    assert (data.name, data.author, data.layer, data.probes) == ("n", "a", 3, None)


def test_model_identity_is_stable_and_sensitive():
    a = model_identity({"dim": 4096, "n_layers": 43}, {"weight_map": {"w": "f1"}})
    assert a == model_identity({"n_layers": 43, "dim": 4096}, {"weight_map": {"w": "f1"}})
    assert a != model_identity({"dim": 4096, "n_layers": 44}, {"weight_map": {"w": "f1"}})
    assert a != model_identity({"dim": 4096, "n_layers": 43}, {"weight_map": {"w": "f2"}})
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", a)


def test_fresh_database_is_at_current_schema(store):
    assert store.schema_version() == SCHEMA_VERSION
    with store.engine.connect() as conn:
        versions = [r[0] for r in conn.execute(sa.text("SELECT version FROM explorer_schema_version ORDER BY version"))]
    assert versions == list(range(1, SCHEMA_VERSION + 1))
    # reopening does not migrate again
    SessionStore(store.url).close()
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM explorer_schema_version")).scalar_one() == SCHEMA_VERSION


def test_newer_schema_is_refused_untouched(db_url):  # noqa: F811
    SessionStore(db_url).close()
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO explorer_schema_version (version, applied_at, description) "
                             "VALUES (99, '2099-01-01T00:00:00.000000Z', 'future')"))
    with pytest.raises(StoreUnavailable, match="newer than this app"):
        SessionStore(db_url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT max(version) FROM explorer_schema_version")).scalar_one() == 99
    engine.dispose()


def test_unreachable_postgres_is_a_clear_message():
    with pytest.raises(StoreUnavailable, match="cannot be used right now") as err:
        SessionStore("postgresql://someone:s3cret@127.0.0.1:1/nowhere", connect_timeout=2)
    assert "s3cret" not in str(err.value)  # password never shown


def test_unusable_sqlite_paths_are_clear_messages(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(StoreUnavailable, match="Cannot create the folder"):
        SessionStore(f"sqlite:///{blocker / 'sub' / 'db.sqlite3'}")
    with pytest.raises(StoreUnavailable, match="not an in-memory"):
        SessionStore("sqlite://")
    with pytest.raises(StoreUnavailable, match="Unsupported"):
        SessionStore("mysql://u@localhost/db")
    not_a_db = tmp_path / "not.sqlite3"
    not_a_db.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreUnavailable):
        SessionStore(f"sqlite:///{not_a_db}")
    assert not_a_db.read_bytes() == b"this is not a database" * 100


def test_postgres_connection_loss_is_survived(pg_url, pg_server_url):  # noqa: F811
    with SessionStore(pg_url) as store:
        saved = store.save(sample(probes=None))
        store.load(saved.id)  # the pool now holds a live connection
        admin = sa.create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            killed = conn.execute(
                sa.text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = :d AND pid <> pg_backend_pid()"),
                {"d": sa.engine.make_url(pg_url).database},
            ).scalar_one()
        admin.dispose()
        assert killed >= 1
        assert store.load(saved.id).name == saved.name
        assert store.set_notes(saved.id, "after the drop").notes == "after the drop"


def test_from_env(tmp_path, pg_url):  # noqa: F811
    path = tmp_path / "deep" / "team.sqlite3"
    with SessionStore.from_env({"EXPLORER_DB_PATH": str(path)}) as store:
        assert store.dialect == "sqlite"
        store.save(sample(probes=None))
    assert path.exists()
    with SessionStore.from_env({"EXPLORER_DB_URL": pg_url, "EXPLORER_DB_PATH": str(path)}) as store:
        assert store.dialect == "postgresql" and store.count() == 0
