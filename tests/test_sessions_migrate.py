"""Opening a database written by an older schema (v1, made here with raw SQL) migrates it and keeps
every session."""

from __future__ import annotations

import json
import zlib

import pytest
import sqlalchemy as sa

from explorer.sessions import SCHEMA_VERSION, SessionStore
from pg_fixture import db_url, pg_server_url, pg_url  # noqa: F401  (fixtures)

# The v1 layout, as v1 of the app wrote it: everything but the probes inside state_json.
V1_DDL = {
    "sqlite": [
        "CREATE TABLE explorer_schema_version (version INTEGER NOT NULL PRIMARY KEY, "
        "applied_at VARCHAR(32) NOT NULL, description TEXT NOT NULL)",
        "CREATE TABLE explorer_sessions (id VARCHAR(64) NOT NULL PRIMARY KEY, name TEXT NOT NULL, "
        "author TEXT NOT NULL, notes TEXT NOT NULL, created_at VARCHAR(32) NOT NULL, "
        "updated_at VARCHAR(32) NOT NULL, model_source TEXT NOT NULL, state_json TEXT NOT NULL, probes BLOB)",
    ],
    "postgresql": [
        "CREATE TABLE explorer_schema_version (version INTEGER NOT NULL PRIMARY KEY, "
        "applied_at VARCHAR(32) NOT NULL, description TEXT NOT NULL)",
        "CREATE TABLE explorer_sessions (id VARCHAR(64) NOT NULL PRIMARY KEY, name TEXT NOT NULL, "
        "author TEXT NOT NULL, notes TEXT NOT NULL, created_at VARCHAR(32) NOT NULL, "
        "updated_at VARCHAR(32) NOT NULL, model_source TEXT NOT NULL, state_json TEXT NOT NULL, probes BYTEA)",
    ],
}

PROBES = {"tokens": ["a", "b"], "token_ids": [7, 8],
          "layers": {"24": {"role": "reindex", "topk": [[0], [0, 1]], "routing": {"experts": [[1, 2, 3, 4, 5, 6]] * 2}}}}

V1_ROWS = [
    {
        "id": "v1sessionAAAAAAAAAAAAA",
        "name": "old layer-24 study",
        "author": "ana",
        "notes": "written by v1",
        "created_at": "2025-01-02T03:04:05.000006Z",
        "updated_at": "2025-01-03T03:04:05.000006Z",
        "model_source": "/models/v41-flash",
        "state_json": json.dumps({
            "prompts": ["The Eiffel Tower is in", "second prompt"],
            "spans": [{"prompt": 0, "start": 1, "end": 3}],
            "layer": 24, "tab": "routing", "view": {"scale": "log"},
            "model_identity": "sha256:" + "ab" * 32, "engine_version": "0.0.9",
        }),
        "probes": zlib.compress(json.dumps(PROBES).encode()),
    },
    {
        # a v1 row with odd state: no layer, a non-integer layer elsewhere must not break the migration
        "id": "v1sessionBBBBBBBBBBBBB",
        "name": "scratch",
        "author": "bo",
        "notes": "",
        "created_at": "2025-02-01T00:00:00.000000Z",
        "updated_at": "2025-02-01T00:00:00.000000Z",
        "model_source": "",
        "state_json": json.dumps({"prompts": ["hello"], "layer": "deep", "tab": None, "view": {}, "spans": []}),
        "probes": None,
    },
]


def make_v1_database(url: str) -> None:
    engine = sa.create_engine(url)
    dialect = "sqlite" if engine.dialect.name == "sqlite" else "postgresql"
    with engine.begin() as conn:
        for ddl in V1_DDL[dialect]:
            conn.exec_driver_sql(ddl)
        conn.execute(sa.text("INSERT INTO explorer_schema_version VALUES (1, '2025-01-01T00:00:00.000000Z', 'sessions table')"))
        for row in V1_ROWS:
            conn.execute(
                sa.text("INSERT INTO explorer_sessions (id, name, author, notes, created_at, updated_at, model_source, "
                        "state_json, probes) VALUES (:id, :name, :author, :notes, :created_at, :updated_at, "
                        ":model_source, :state_json, :probes)"),
                row,
            )
    engine.dispose()


def test_v1_database_is_migrated_with_data_preserved(db_url):  # noqa: F811
    make_v1_database(db_url)
    with SessionStore(db_url) as store:
        assert store.schema_version() == SCHEMA_VERSION == 2

        old = store.load("v1sessionAAAAAAAAAAAAA")
        assert old.name == "old layer-24 study" and old.author == "ana" and old.notes == "written by v1"
        assert old.prompts == ["The Eiffel Tower is in", "second prompt"]
        assert old.spans == [{"prompt": 0, "start": 1, "end": 3}]
        assert (old.layer, old.tab, old.view) == (24, "routing", {"scale": "log"})
        assert old.model_identity == "sha256:" + "ab" * 32 and old.engine_version == "0.0.9"
        assert old.probes == PROBES
        assert old.revision == 1
        assert old.created_at.isoformat() == "2025-01-02T03:04:05.000006+00:00"

        odd = store.load("v1sessionBBBBBBBBBBBBB")
        assert odd.layer is None and odd.prompts == ["hello"] and odd.probes is None

        # the new columns work: search by layer and by prompt text, revisions, soft delete
        assert [s.id for s in store.list_sessions(layer=24)] == ["v1sessionAAAAAAAAAAAAA"]
        assert [s.id for s in store.list_sessions("eiffel")] == ["v1sessionAAAAAAAAAAAAA"]
        assert [s.id for s in store.list_sessions()] == ["v1sessionBBBBBBBBBBBBB", "v1sessionAAAAAAAAAAAAA"]
        assert store.set_notes(old.id, "edited after migration", expected_revision=1).revision == 2
        store.delete(odd.id)
        assert store.count() == 1

    with sa.create_engine(db_url).connect() as conn:
        versions = [r[0] for r in conn.execute(sa.text("SELECT version FROM explorer_schema_version ORDER BY version"))]
        state = json.loads(conn.execute(
            sa.text("SELECT state_json FROM explorer_sessions WHERE id = 'v1sessionAAAAAAAAAAAAA'")).scalar_one())
    assert versions == [1, 2]
    assert "layer" not in state and "model_identity" not in state  # moved into their own columns

    # a second open finds nothing to do and loses nothing
    with SessionStore(db_url) as store:
        assert store.load("v1sessionAAAAAAAAAAAAA").notes == "edited after migration"


def test_failed_migration_rolls_back(db_url, monkeypatch):  # noqa: F811
    """A migration that dies half-way leaves the v1 database exactly as it was."""
    import explorer.sessions as sessions

    make_v1_database(db_url)

    def broken(conn):
        conn.exec_driver_sql("ALTER TABLE explorer_sessions ADD COLUMN half_done INTEGER")
        raise sa.exc.OperationalError("ALTER ...", {}, Exception("disk on fire"))

    monkeypatch.setattr(sessions, "MIGRATIONS", [sessions.MIGRATIONS[0], (2, "broken", broken)])
    with pytest.raises(sessions.StoreUnavailable, match="disk on fire"):
        sessions.SessionStore(db_url)

    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT max(version) FROM explorer_schema_version")).scalar_one() == 1
        columns = {c["name"] for c in sa.inspect(conn).get_columns("explorer_sessions")}
        assert "half_done" not in columns and "layer" not in columns
        assert conn.execute(sa.text("SELECT count(*) FROM explorer_sessions")).scalar_one() == 2
    engine.dispose()
