"""The session tables and the ordered migrations that build them."""

from __future__ import annotations

import json
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .model import _prompt_search_text

_metadata = sa.MetaData()

sessions_table = sa.Table(
    "explorer_sessions",
    _metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("author", sa.Text, nullable=False),
    sa.Column("notes", sa.Text, nullable=False),
    sa.Column("created_at", sa.String(32), nullable=False),
    sa.Column("updated_at", sa.String(32), nullable=False),
    sa.Column("model_source", sa.Text, nullable=False),
    # prompts, spans, tab, view (and, in v1, everything else) as JSON text
    sa.Column("state_json", sa.Text, nullable=False),
    sa.Column("probes", sa.LargeBinary, nullable=True),
    # added in v2
    sa.Column("model_identity", sa.Text, nullable=False),
    sa.Column("engine_version", sa.Text, nullable=False),
    sa.Column("layer", sa.Integer, nullable=True),
    sa.Column("prompt_text", sa.Text, nullable=False),
    sa.Column("revision", sa.Integer, nullable=False),
    sa.Column("deleted_at", sa.String(32), nullable=True),
)

schema_version_table = sa.Table(
    "explorer_schema_version",
    _metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("applied_at", sa.String(32), nullable=False),
    sa.Column("description", sa.Text, nullable=False),
)


def _migrate_v1(conn: Connection) -> None:
    """v1: the first layout: one row per session, everything but probes inside ``state_json``."""
    v1 = sa.MetaData()
    sa.Table(
        "explorer_sessions",
        v1,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("author", sa.Text, nullable=False),
        sa.Column("notes", sa.Text, nullable=False),
        sa.Column("created_at", sa.String(32), nullable=False),
        sa.Column("updated_at", sa.String(32), nullable=False),
        sa.Column("model_source", sa.Text, nullable=False),
        sa.Column("state_json", sa.Text, nullable=False),
        sa.Column("probes", sa.LargeBinary, nullable=True),
    )
    v1.create_all(conn)


def _migrate_v2(conn: Connection) -> None:
    """v2: searchable columns (layer, prompt text), identity, engine version, revision, soft delete.

    Backfills the new columns from v1's ``state_json`` and drops those keys from it.
    """
    for ddl in (
        "ALTER TABLE explorer_sessions ADD COLUMN model_identity TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE explorer_sessions ADD COLUMN engine_version TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE explorer_sessions ADD COLUMN layer INTEGER",
        "ALTER TABLE explorer_sessions ADD COLUMN prompt_text TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE explorer_sessions ADD COLUMN revision INTEGER NOT NULL DEFAULT 1",
        "ALTER TABLE explorer_sessions ADD COLUMN deleted_at VARCHAR(32)",
        "CREATE INDEX ix_explorer_sessions_updated ON explorer_sessions (updated_at)",
        "CREATE INDEX ix_explorer_sessions_author ON explorer_sessions (author)",
        "CREATE INDEX ix_explorer_sessions_layer ON explorer_sessions (layer)",
    ):
        conn.exec_driver_sql(ddl)

    t = sessions_table
    rows = conn.execute(sa.select(t.c.id, t.c.state_json)).all()
    for row_id, state_json in rows:
        try:
            state = json.loads(state_json)
        except ValueError:
            state = {}
        if not isinstance(state, dict):
            state = {}
        prompts = [p for p in state.get("prompts", []) if isinstance(p, str)]
        layer = state.pop("layer", None)
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            layer = None
        identity = state.pop("model_identity", "")
        engine_version = state.pop("engine_version", "")
        conn.execute(
            t.update()
            .where(t.c.id == row_id)
            .values(
                layer=layer,
                prompt_text=_prompt_search_text(prompts),
                model_identity=identity if isinstance(identity, str) else "",
                engine_version=engine_version if isinstance(engine_version, str) else "",
                state_json=json.dumps(state, ensure_ascii=False),
            )
        )


# (version, description, function); applied in order, each in the migration transaction.
MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "sessions table", _migrate_v1),
    (2, "search columns, identity, engine version, revision, soft delete", _migrate_v2),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]
