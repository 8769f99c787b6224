"""Saved analysis sessions, shared by a team: storage through SQLAlchemy Core.

A session is what someone looked at (model identity, prompts, token-span marks, layer, tab, view
settings) plus the run's probe results, stored zlib-compressed so that a shared link opens without
the model. SQLite file by default; PostgreSQL when ``EXPLORER_DB_URL`` names one.

Safe with several app processes writing at once:
- SQLite runs in WAL mode with a busy timeout; every write transaction starts with
  ``BEGIN IMMEDIATE`` (takes the write lock up front, so no deadlock on lock upgrade) and is
  retried on "database is locked".
- PostgreSQL write transactions are retried on serialization failures and deadlocks.
- Schema migrations run under a lock (``BEGIN IMMEDIATE`` / ``pg_advisory_xact_lock``), so many
  processes opening a fresh database at once migrate it exactly once.
- Edits carry a ``revision``: pass ``expected_revision`` to refuse overwriting someone else's edit.

Every value reaches the database as a bound parameter; nothing user-typed is formatted into SQL.
The UI must still escape user text when showing it.
"""


from .model import (
    DamagedSession, SavedButUnreadable, EXPORT_FORMAT, EXPORT_VERSION, MAX_AUTHOR, MAX_IMPORT_BYTES, MAX_NAME, MAX_NOTES, MAX_PROMPT_CHARS,
    InvalidSessionData, InvalidSessionFile, Session, SessionConflict, SessionData, SessionError, SessionNotFound,
    SessionSummary, StoreUnavailable, compress_probes, decompress_probes, default_sqlite_path, is_valid_session_id,
    model_identity, new_session_id)
from .schema import MIGRATIONS, SCHEMA_VERSION, schema_version_table, sessions_table
from .rows import SessionList
from .store import SessionStore
from .transfer import parse_export, session_to_export

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "SCHEMA_VERSION",
    "DamagedSession",
    "InvalidSessionData",
    "InvalidSessionFile",
    "SavedButUnreadable",
    "Session",
    "SessionConflict",
    "SessionData",
    "SessionError",
    "SessionList",
    "SessionNotFound",
    "SessionStore",
    "SessionSummary",
    "StoreUnavailable",
    "compress_probes",
    "decompress_probes",
    "default_sqlite_path",
    "is_valid_session_id",
    "model_identity",
    "new_session_id",
    "parse_export",
    "session_to_export",
]
