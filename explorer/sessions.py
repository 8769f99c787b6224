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

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import secrets
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "SCHEMA_VERSION",
    "InvalidSessionData",
    "InvalidSessionFile",
    "Session",
    "SessionConflict",
    "SessionData",
    "SessionError",
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

EXPORT_FORMAT = "v41-flash-explorer-session"
EXPORT_VERSION = 1
MAX_IMPORT_BYTES = 256 * 1024 * 1024

MAX_NAME = 200
MAX_AUTHOR = 100
MAX_NOTES = 50_000
MAX_PROMPT_CHARS = 200_000

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
_LAYER_WORD_RE = re.compile(r"^layer[:=](\d{1,5})$", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------
# errors: each carries a message fit to show a user as is


class SessionError(Exception):
    """Base of every error this module raises on purpose; str(err) is a user-facing message."""


class SessionNotFound(SessionError):
    """No session with that id (never existed, malformed id, or deleted)."""

    def __init__(self, session_id: str, deleted: bool = False):
        self.session_id = session_id
        self.deleted = deleted
        shown = session_id if len(session_id) <= 64 else session_id[:64] + "..."
        if deleted:
            msg = f"Session {shown!r} was deleted."
        else:
            msg = f"No saved session has the id {shown!r}; the link may be wrong or out of date."
        super().__init__(msg)


class StoreUnavailable(SessionError):
    """The session database cannot be reached or used; nothing was changed."""


class InvalidSessionFile(SessionError):
    """An import file that is not a session export (or is damaged, or from a newer app)."""


class InvalidSessionData(SessionError):
    """A field given to save/update has the wrong type or is out of bounds."""


class SessionConflict(SessionError):
    """Someone else changed the session since it was loaded (revision mismatch)."""

    def __init__(self, session_id: str, expected: int, actual: int):
        self.session_id = session_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"Session {session_id!r} was changed by someone else (revision {actual}, you edited "
            f"revision {expected}). Reload it and apply your change again; nothing was overwritten."
        )


# ----------------------------------------------------------------------------------------------
# value objects


@dataclass(kw_only=True)
class SessionData:
    """What the user saves. ``probes`` is the engine's ``RunResult.to_json()`` dict (opaque here)."""

    name: str
    author: str
    notes: str = ""
    model_source: str = ""
    model_identity: str = ""
    engine_version: str = ""
    prompts: list[str] = field(default_factory=list)
    # token-span marks, e.g. {"prompt": 0, "start": 3, "end": 7, "label": "subject"}
    spans: list[dict[str, Any]] = field(default_factory=list)
    layer: int | None = None
    tab: str | None = None
    view: dict[str, Any] = field(default_factory=dict)
    probes: dict[str, Any] | None = None


@dataclass(kw_only=True)
class Session(SessionData):
    """A stored session. ``revision`` goes up by one on every change."""

    id: str
    created_at: datetime
    updated_at: datetime
    revision: int

    def data(self) -> SessionData:
        """The editable part, e.g. to save a copy."""
        return SessionData(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SessionData)})


@dataclass(frozen=True, kw_only=True)
class SessionSummary:
    """One row of a listing: no probes, no view settings."""

    id: str
    name: str
    author: str
    layer: int | None
    prompts: list[str]
    model_source: str
    notes_preview: str
    created_at: datetime
    updated_at: datetime
    revision: int


_EDITABLE = frozenset(f.name for f in dataclasses.fields(SessionData))


# ----------------------------------------------------------------------------------------------
# small helpers


def new_session_id() -> str:
    """A URL-safe, unguessable id (128 random bits)."""
    return secrets.token_urlsafe(16)


def is_valid_session_id(value: object) -> bool:
    """True when ``value`` looks like a session id (cheap check before touching the database)."""
    return isinstance(value, str) and bool(_ID_RE.match(value))


def model_identity(config: Mapping[str, Any] | bytes | str, checkpoint: Mapping[str, Any] | bytes | str | None) -> str:
    """A stable hash of the model config and the checkpoint's index/headers: ``"sha256:<hex>"``.

    Mappings are hashed as canonical JSON (sorted keys), so key order does not matter.
    """
    digest = hashlib.sha256()
    for part in (config, checkpoint):
        if part is None:
            blob = b"null"
        elif isinstance(part, bytes):
            blob = part
        elif isinstance(part, str):
            blob = part.encode("utf-8")
        else:
            blob = json.dumps(part, sort_keys=True, separators=(",", ":")).encode("utf-8")
        digest.update(len(blob).to_bytes(8, "big"))
        digest.update(blob)
    return "sha256:" + digest.hexdigest()


def compress_probes(probes: Mapping[str, Any] | None) -> bytes | None:
    """zlib-compressed compact JSON, or None."""
    if probes is None:
        return None
    raw = json.dumps(probes, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return zlib.compress(raw, 6)


def decompress_probes(blob: bytes | memoryview | None) -> dict[str, Any] | None:
    if blob is None:
        return None
    return json.loads(zlib.decompress(bytes(blob)).decode("utf-8"))


def default_sqlite_path() -> Path:
    """``EXPLORER_DB_PATH`` or ``$XDG_DATA_HOME/v41-flash-explorer/sessions.sqlite3``."""
    configured = os.environ.get("EXPLORER_DB_PATH")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "v41-flash-explorer" / "sessions.sqlite3"


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(moment: datetime) -> str:
    # Fixed width, UTC: sorts as text identically on every backend.
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_iso(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)


def _prompt_search_text(prompts: Iterable[str]) -> str:
    return "\n".join(prompts)


# ----------------------------------------------------------------------------------------------
# validation


def _check_text(label: str, value: object, limit: int, *, required: bool = False) -> str:
    if not isinstance(value, str):
        raise InvalidSessionData(f"{label} must be text, got {type(value).__name__}.")
    if "\x00" in value:
        raise InvalidSessionData(f"{label} contains a NUL character.")
    if required and not value.strip():
        raise InvalidSessionData(f"{label} must not be empty.")
    if len(value) > limit:
        raise InvalidSessionData(f"{label} is too long ({len(value)} characters, at most {limit}).")
    return value


def _json_able(label: str, value: object) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise InvalidSessionData(f"{label} is not JSON data: {exc}.") from None


def _validate_field(name: str, value: Any) -> Any:
    """Check one editable field; returns the (normalized) value."""
    if name == "name":
        return _check_text("The session name", value, MAX_NAME, required=True).strip()
    if name == "author":
        return _check_text("The author", value, MAX_AUTHOR, required=True).strip()
    if name == "notes":
        return _check_text("The notes", value, MAX_NOTES)
    if name in ("model_source", "model_identity", "engine_version"):
        return _check_text(name.replace("_", " ").capitalize(), value, 2_000)
    if name == "prompts":
        if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
            raise InvalidSessionData("Prompts must be a list of texts.")
        if sum(len(p) for p in value) > MAX_PROMPT_CHARS:
            raise InvalidSessionData(f"The prompts are too long (at most {MAX_PROMPT_CHARS} characters).")
        for p in value:
            _check_text("A prompt", p, MAX_PROMPT_CHARS)
        return list(value)
    if name == "spans":
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, dict) for s in value):
            raise InvalidSessionData("Token-span marks must be a list of objects.")
        _json_able("The token-span marks", list(value))
        return [dict(s) for s in value]
    if name == "layer":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > 10_000:
            raise InvalidSessionData(f"The layer must be a non-negative whole number, got {value!r}.")
        return int(value)
    if name == "tab":
        if value is None:
            return None
        return _check_text("The tab", value, 200)
    if name == "view":
        if not isinstance(value, dict):
            raise InvalidSessionData("View settings must be an object.")
        _json_able("The view settings", value)
        return dict(value)
    if name == "probes":
        if value is None:
            return None
        if not isinstance(value, dict):
            raise InvalidSessionData("Probe results must be an object (the engine's RunResult.to_json()).")
        _json_able("The probe results", value)
        return value
    raise InvalidSessionData(f"Unknown session field {name!r}.")


def _validated(data: SessionData) -> SessionData:
    return SessionData(**{f: _validate_field(f, getattr(data, f)) for f in _EDITABLE})


# ----------------------------------------------------------------------------------------------
# schema: the current tables, and ordered migrations that build them

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


# ----------------------------------------------------------------------------------------------
# the store

T = TypeVar("T")

_PG_RETRY_SQLSTATES = {"40001", "40P01"}  # serialization failure, deadlock detected


def _normalize_url(url: str | URL) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreUnavailable("The session database URL is not a valid database URL.") from None
    if parsed.drivername in ("postgres", "postgresql", "postgresql+psycopg2"):
        # psycopg (v3) is the driver we ship
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername not in ("sqlite", "sqlite+pysqlite", "postgresql+psycopg"):
        raise StoreUnavailable(
            f"Unsupported session database {parsed.drivername!r}: use a SQLite file or a PostgreSQL URL."
        )
    return parsed


class SessionStore:
    """Saved sessions in one database. Thread-safe; make one per process and share it.

    ``url``: a SQLAlchemy URL (``sqlite:///path`` or ``postgresql://user@host/db``); None means the
    SQLite file at ``default_sqlite_path()``. Opening migrates the schema to ``SCHEMA_VERSION``.
    Raises ``StoreUnavailable`` when the database cannot be reached or is newer than this code.
    """

    def __init__(self, url: str | URL | None = None, *, connect_timeout: float = 5.0, busy_timeout: float = 30.0):
        if url is None:
            path = default_sqlite_path()
            url = URL.create("sqlite", database=str(path))
        self.url = _normalize_url(url)
        self.dialect = "sqlite" if self.url.drivername.startswith("sqlite") else "postgresql"
        self._max_attempts = 8
        if self.dialect == "sqlite":
            database = self.url.database or ""
            if database in ("", ":memory:") or database.startswith("file:"):
                raise StoreUnavailable("Sessions need a SQLite file (a shared path), not an in-memory database.")
            try:
                Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreUnavailable(f"Cannot create the folder for the session database {database!r}: {exc.strerror}.") from None
            self.engine = sa.create_engine(
                self.url,
                connect_args={"timeout": busy_timeout, "check_same_thread": False},
                pool_pre_ping=False,
            )
            _install_sqlite_transactions(self.engine)
        else:
            self.engine = sa.create_engine(
                self.url,
                connect_args={"connect_timeout": max(1, int(connect_timeout))},
                pool_pre_ping=True,
                pool_size=5,
                max_overflow=10,
            )
        try:
            self._migrate()
        except BaseException:
            self.engine.dispose()
            raise

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SessionStore":
        """``EXPLORER_DB_URL`` when set, else the SQLite file (``EXPLORER_DB_PATH`` or the default)."""
        env = os.environ if environ is None else environ
        url = env.get("EXPLORER_DB_URL") or None
        if url is None and env.get("EXPLORER_DB_PATH"):
            url = URL.create("sqlite", database=str(Path(env["EXPLORER_DB_PATH"]).expanduser()))
        return cls(url)

    def describe(self) -> str:
        """Where the sessions live, password hidden (for messages and the UI)."""
        return self.url.render_as_string(hide_password=True)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> "SessionStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions ----------------------------------------------------------------------

    def _is_transient(self, exc: DBAPIError) -> bool:
        if self.dialect == "sqlite":
            text = str(exc.orig).lower()
            return "database is locked" in text or "database is busy" in text or "database table is locked" in text
        return getattr(exc.orig, "sqlstate", None) in _PG_RETRY_SQLSTATES

    def _transaction(self, work: Callable[[Connection], T], *, write: bool) -> T:
        """Run ``work(conn)`` in one transaction, retrying lock/serialization conflicts."""
        delay = 0.02
        for attempt in range(1, self._max_attempts + 1):
            try:
                with self.engine.connect() as conn:
                    if self.dialect == "sqlite":
                        conn.execution_options(explorer_sqlite_begin="BEGIN IMMEDIATE" if write else "BEGIN")
                    with conn.begin():
                        return work(conn)
            except SessionError:
                raise
            except DBAPIError as exc:
                if attempt < self._max_attempts and (self._is_transient(exc) or exc.connection_invalidated):
                    time.sleep(delay * (1 + random.random()))
                    delay = min(delay * 2, 1.0)
                    continue
                raise self._unavailable(exc) from exc
            except SQLAlchemyError as exc:
                raise self._unavailable(exc) from exc
        raise AssertionError("unreachable")

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        orig = getattr(exc, "orig", None) or exc
        detail = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        return StoreUnavailable(
            f"The session database ({self.describe()}) cannot be used right now: {detail}. "
            "Nothing was changed; try again, or ask whoever runs the database."
        )

    def _migrate(self) -> None:
        def work(conn: Connection) -> None:
            if self.dialect == "postgresql":
                # One migrator at a time across every process and host; released at commit.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": 0x7E5510})
            schema_version_table.create(conn, checkfirst=True)
            current = conn.execute(sa.select(sa.func.max(schema_version_table.c.version))).scalar() or 0
            if current > SCHEMA_VERSION:
                raise StoreUnavailable(
                    f"The session database ({self.describe()}) has schema version {current}, newer than "
                    f"this app understands ({SCHEMA_VERSION}). Upgrade the app; the database was not touched."
                )
            for version, description, migrate in MIGRATIONS:
                if version <= current:
                    continue
                migrate(conn)
                conn.execute(
                    schema_version_table.insert().values(version=version, applied_at=_iso(_now()), description=description)
                )

        self._transaction(work, write=True)

    def schema_version(self) -> int:
        return self._transaction(
            lambda conn: conn.execute(sa.select(sa.func.max(schema_version_table.c.version))).scalar() or 0,
            write=False,
        )

    # -- rows ------------------------------------------------------------------------------

    @staticmethod
    def _row_values(data: SessionData) -> dict[str, Any]:
        state = {"prompts": data.prompts, "spans": data.spans, "tab": data.tab, "view": data.view}
        return {
            "name": data.name,
            "author": data.author,
            "notes": data.notes,
            "model_source": data.model_source,
            "model_identity": data.model_identity,
            "engine_version": data.engine_version,
            "layer": data.layer,
            "prompt_text": _prompt_search_text(data.prompts),
            "state_json": json.dumps(state, ensure_ascii=False),
            "probes": compress_probes(data.probes),
        }

    @staticmethod
    def _session_from_row(row: Any, *, with_probes: bool = True) -> Session:
        state = json.loads(row.state_json)
        try:
            probes = decompress_probes(row.probes) if with_probes else None
        except (zlib.error, ValueError) as exc:
            raise StoreUnavailable(f"The stored probe results of session {row.id!r} are damaged ({exc}).") from None
        return Session(
            id=row.id,
            name=row.name,
            author=row.author,
            notes=row.notes,
            model_source=row.model_source,
            model_identity=row.model_identity,
            engine_version=row.engine_version,
            prompts=list(state.get("prompts", [])),
            spans=list(state.get("spans", [])),
            layer=row.layer,
            tab=state.get("tab"),
            view=dict(state.get("view", {})),
            probes=probes,
            created_at=_parse_iso(row.created_at),
            updated_at=_parse_iso(row.updated_at),
            revision=row.revision,
        )

    def _fetch(self, conn: Connection, session_id: str, *, include_deleted: bool = False) -> Any:
        if not is_valid_session_id(session_id):
            raise SessionNotFound(str(session_id))
        row = conn.execute(sa.select(sessions_table).where(sessions_table.c.id == session_id)).one_or_none()
        if row is None:
            raise SessionNotFound(session_id)
        if row.deleted_at is not None and not include_deleted:
            raise SessionNotFound(session_id, deleted=True)
        return row

    # -- public operations -----------------------------------------------------------------

    def save(self, data: SessionData) -> Session:
        """Store a new session; returns it with its new id."""
        clean = _validated(data)
        values = self._row_values(clean)
        stamp = _iso(_now())
        session_id = new_session_id()

        def work(conn: Connection) -> None:
            conn.execute(
                sessions_table.insert().values(
                    id=session_id, created_at=stamp, updated_at=stamp, revision=1, deleted_at=None, **values
                )
            )

        self._transaction(work, write=True)
        return self.load(session_id)

    def load(self, session_id: str) -> Session:
        """The session with that id, probes included. Raises ``SessionNotFound``."""
        return self._transaction(lambda conn: self._session_from_row(self._fetch(conn, session_id)), write=False)

    def list_sessions(
        self,
        query: str = "",
        *,
        author: str | None = None,
        layer: int | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[SessionSummary]:
        """Sessions, newest change first. ``query``: every whitespace-separated word must appear
        (case-insensitive) in the name, author, prompt text or notes; a word ``layer:N`` filters by
        layer instead (so one search box covers all). ``author``/``layer``: exact filters."""
        t = sessions_table
        stmt = sa.select(
            t.c.id, t.c.name, t.c.author, t.c.layer, t.c.state_json, t.c.model_source, t.c.notes,
            t.c.created_at, t.c.updated_at, t.c.revision,
        ).where(t.c.deleted_at.is_(None))
        for word in (query or "").split():
            layer_word = _LAYER_WORD_RE.match(word)
            if layer_word:
                stmt = stmt.where(t.c.layer == int(layer_word.group(1)))
                continue
            stmt = stmt.where(
                sa.or_(
                    t.c.name.icontains(word, autoescape=True),
                    t.c.author.icontains(word, autoescape=True),
                    t.c.prompt_text.icontains(word, autoescape=True),
                    t.c.notes.icontains(word, autoescape=True),
                )
            )
        if author is not None:
            stmt = stmt.where(t.c.author == author)
        if layer is not None:
            stmt = stmt.where(t.c.layer == int(layer))
        stmt = stmt.order_by(t.c.updated_at.desc(), t.c.id).limit(max(0, int(limit))).offset(max(0, int(offset)))

        def work(conn: Connection) -> list[SessionSummary]:
            out = []
            for row in conn.execute(stmt):
                state = json.loads(row.state_json)
                out.append(
                    SessionSummary(
                        id=row.id,
                        name=row.name,
                        author=row.author,
                        layer=row.layer,
                        prompts=list(state.get("prompts", [])),
                        model_source=row.model_source,
                        notes_preview=row.notes[:200],
                        created_at=_parse_iso(row.created_at),
                        updated_at=_parse_iso(row.updated_at),
                        revision=row.revision,
                    )
                )
            return out

        return self._transaction(work, write=False)

    def count(self) -> int:
        """How many sessions are not deleted."""
        t = sessions_table
        return self._transaction(
            lambda conn: conn.execute(sa.select(sa.func.count()).select_from(t).where(t.c.deleted_at.is_(None))).scalar_one(),
            write=False,
        )

    def update(self, session_id: str, *, expected_revision: int | None = None, **changes: Any) -> Session:
        """Change some fields (names as in ``SessionData``). With ``expected_revision``, refuse with
        ``SessionConflict`` if the session changed since that revision."""
        unknown = set(changes) - _EDITABLE
        if unknown:
            raise InvalidSessionData(f"Unknown session field(s): {', '.join(sorted(unknown))}.")
        clean = {k: _validate_field(k, v) for k, v in changes.items()}

        def work(conn: Connection) -> None:
            row = self._fetch(conn, session_id)
            if expected_revision is not None and row.revision != expected_revision:
                raise SessionConflict(session_id, expected_revision, row.revision)
            current = self._session_from_row(row, with_probes=False).data()  # probes: kept as bytes or replaced
            merged = dataclasses.replace(current, **clean)
            values = self._row_values(merged)
            if "probes" not in clean:
                values["probes"] = row.probes  # keep the stored bytes; no recompression
            t = sessions_table
            # the revision guard in WHERE makes a lost update impossible even under READ COMMITTED
            result = conn.execute(
                t.update()
                .where(t.c.id == session_id, t.c.revision == row.revision)
                .values(updated_at=_iso(_now()), revision=row.revision + 1, **values)
            )
            if result.rowcount != 1:
                latest = conn.execute(sa.select(t.c.revision).where(t.c.id == session_id)).scalar()
                if expected_revision is not None:
                    raise SessionConflict(session_id, expected_revision, latest or -1)
                raise _RetryUpdate()

        for _ in range(self._max_attempts):
            try:
                self._transaction(work, write=True)
                break
            except _RetryUpdate:
                continue
        else:
            raise StoreUnavailable(f"Session {session_id!r} is being changed too often to update; try again.")
        return self.load(session_id)

    def rename(self, session_id: str, name: str, *, expected_revision: int | None = None) -> Session:
        return self.update(session_id, name=name, expected_revision=expected_revision)

    def set_notes(self, session_id: str, notes: str, *, expected_revision: int | None = None) -> Session:
        return self.update(session_id, notes=notes, expected_revision=expected_revision)

    def duplicate(self, session_id: str, *, name: str | None = None, author: str | None = None) -> Session:
        """A new session with the same content (probes copied as stored)."""
        source = self.load(session_id)
        data = source.data()
        data.name = name if name is not None else _copy_name(source.name)
        if author is not None:
            data.author = author
        return self.save(data)

    def delete(self, session_id: str) -> None:
        """Mark deleted: it no longer opens or lists; ``restore`` brings it back."""

        def work(conn: Connection) -> None:
            row = self._fetch(conn, session_id)
            t = sessions_table
            conn.execute(
                t.update().where(t.c.id == row.id).values(deleted_at=_iso(_now()), revision=row.revision + 1)
            )

        self._transaction(work, write=True)

    def restore(self, session_id: str) -> Session:
        """Undo ``delete``."""

        def work(conn: Connection) -> None:
            row = self._fetch(conn, session_id, include_deleted=True)
            t = sessions_table
            conn.execute(t.update().where(t.c.id == row.id).values(deleted_at=None, revision=row.revision + 1))

        self._transaction(work, write=True)
        return self.load(session_id)

    def purge(self, session_id: str) -> None:
        """Remove a session's row for good (deleted or not)."""

        def work(conn: Connection) -> None:
            row = self._fetch(conn, session_id, include_deleted=True)
            conn.execute(sessions_table.delete().where(sessions_table.c.id == row.id))

        self._transaction(work, write=True)

    def export_json(self, session_id: str) -> str:
        """The session as a JSON document for a file (see ``session_to_export``)."""
        return json.dumps(session_to_export(self.load(session_id)), ensure_ascii=False, indent=1)

    def import_json(self, document: str | bytes | Mapping[str, Any], *, author: str | None = None) -> Session:
        """Store an exported session as a new session (new id). Raises ``InvalidSessionFile``."""
        data = parse_export(document)
        if author is not None:
            data.author = author
        return self.save(data)


class _RetryUpdate(Exception):
    """Internal: the row changed between read and write; run the update again."""


def _copy_name(name: str) -> str:
    candidate = f"{name} (copy)"
    return candidate if len(candidate) <= MAX_NAME else candidate[-MAX_NAME:]


def _install_sqlite_transactions(engine: Engine) -> None:
    """Let SQLAlchemy (not the sqlite3 module) own BEGIN, so reads are real transactions and
    writes can take the lock up front with BEGIN IMMEDIATE; WAL lets readers run beside a writer."""

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # autocommit in the driver; we emit BEGIN ourselves
        cursor = dbapi_conn.cursor()
        try:
            # Switching to WAL needs a moment of exclusive access; another process may hold it.
            for attempt in range(50):
                try:
                    cursor.execute("PRAGMA journal_mode=WAL")
                    break
                except Exception as exc:  # sqlite3.OperationalError: database is locked
                    if "locked" not in str(exc).lower() or attempt == 49:
                        raise
                    time.sleep(0.05)
            cursor.execute("PRAGMA foreign_keys=ON")
        finally:
            cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql(conn.get_execution_options().get("explorer_sqlite_begin", "BEGIN"))


# ----------------------------------------------------------------------------------------------
# export / import


def session_to_export(session: Session) -> dict[str, Any]:
    """A JSON-able document: format marker, version, and the session's fields (probes as JSON)."""
    body = {f.name: getattr(session, f.name) for f in dataclasses.fields(SessionData)}
    body["id"] = session.id
    body["created_at"] = _iso(session.created_at)
    body["updated_at"] = _iso(session.updated_at)
    return {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION, "exported_at": _iso(_now()), "session": body}


def parse_export(document: str | bytes | Mapping[str, Any]) -> SessionData:
    """Validate an export document and return its content. Raises ``InvalidSessionFile``."""
    if isinstance(document, (bytes, bytearray)):
        if len(document) > MAX_IMPORT_BYTES:
            raise InvalidSessionFile(f"The file is too large for a session export (over {MAX_IMPORT_BYTES // 2**20} MiB).")
        try:
            document = bytes(document).decode("utf-8-sig")
        except UnicodeDecodeError:
            raise InvalidSessionFile("The file is not a session export: it is not UTF-8 text.") from None
    if isinstance(document, str):
        if len(document) > MAX_IMPORT_BYTES:
            raise InvalidSessionFile("The file is too large for a session export.")
        try:
            document = json.loads(document)
        except (ValueError, RecursionError) as exc:
            raise InvalidSessionFile(f"The file is not a session export: it is not valid JSON ({exc}).") from None
    if not isinstance(document, Mapping):
        raise InvalidSessionFile("The file is not a session export: it does not hold a JSON object.")
    if document.get("format") != EXPORT_FORMAT:
        raise InvalidSessionFile(
            f"The file is not a session export of this app (expected \"format\": \"{EXPORT_FORMAT}\")."
        )
    version = document.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidSessionFile("The session file has no valid \"format_version\".")
    if version > EXPORT_VERSION:
        raise InvalidSessionFile(
            f"The session file was made by a newer version of the app (format {version}; this app reads up to {EXPORT_VERSION})."
        )
    if version < 1:
        raise InvalidSessionFile(f"The session file has an unknown format version {version}.")
    body = document.get("session")
    if not isinstance(body, Mapping):
        raise InvalidSessionFile("The session file has no \"session\" object.")
    missing = [k for k in ("name", "author") if k not in body]
    if missing:
        raise InvalidSessionFile(f"The session file lacks {', '.join(missing)}.")
    values: dict[str, Any] = {}
    for name in _EDITABLE:
        if name not in body:
            continue
        try:
            values[name] = _validate_field(name, body[name])
        except InvalidSessionData as exc:
            raise InvalidSessionFile(f"The session file is damaged: {exc}") from None
    return SessionData(**values)
