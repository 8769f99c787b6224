"""SessionStore: saved sessions in a SQLite file or a PostgreSQL database (see the package docstring)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError

from . import schema
from .model import (
    _EDITABLE, _LAYER_WORD_RE, MAX_NAME, DamagedSession, InvalidSessionData, SavedButUnreadable, Session, SessionConflict,
    SessionData, SessionError, SessionNotFound, StoreUnavailable, _iso, _now, _prompt_search_text, _validate_field,
    _validated, compress_probes, default_sqlite_path, is_valid_session_id, new_session_id)
from .rows import SessionList, session_from_row, summary_from_row
from .schema import schema_version_table, sessions_table
from .transfer import parse_export, session_to_export

T = TypeVar("T")
_log = logging.getLogger(__name__)

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
    SQLite file at ``default_sqlite_path()``. Opening migrates the schema to ``schema.SCHEMA_VERSION``.
    Raises ``StoreUnavailable`` when the database cannot be reached or is newer than this code.
    """

    def __init__(self, url: str | URL | None = None, *, connect_timeout: float = 5.0, busy_timeout: float = 30.0):
        if url is None:
            path = default_sqlite_path()
            url = URL.create("sqlite", database=str(path))
        self.url = _normalize_url(url)
        self.dialect = "sqlite" if self.url.drivername.startswith("sqlite") else "postgresql"
        self._max_attempts = 8
        self._file: Path | None = None          # the SQLite file, and its identity when opened
        self._file_id: tuple[int, int] | None = None
        self._settled = False
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
            self._file = Path(database).expanduser()
        else:
            # synchronous_commit on for our sessions whatever the server's default: with it off, a
            # server stopped abruptly loses commits it had already acknowledged (saves the user saw).
            options = " ".join(filter(None, [self.url.query.get("options"), "-c synchronous_commit=on"]))
            self.engine = sa.create_engine(
                self.url,
                connect_args={"connect_timeout": max(1, int(connect_timeout)), "options": options},
                pool_pre_ping=True,
                pool_size=5,
                max_overflow=10,
            )
        try:
            self._migrate()
            if self._file is not None:
                self._file_id = self._identity()
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

    def _identity(self) -> tuple[int, int] | None:
        """(device, inode) of the SQLite file now; None when the path is gone."""
        try:
            st = os.stat(self._file)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _check_file(self, *, settle: bool = False) -> None:
        """Refuse to use a SQLite file that was deleted or replaced (e.g. a backup moved over it) since
        it was opened: open connections would keep using the old, unlinked file and every save would
        vanish when the app restarts.

        ``settle`` (outside any transaction): the first time, move the old file's write-ahead log into
        the old file and empty it; left behind, the next open would replay it over the new file."""
        if self._file_id is None:
            return
        now = self._identity()
        if now == self._file_id:
            return
        what = "deleted or moved away" if now is None else "replaced by another file"
        if settle and not self._settled:
            self._settled = True
            try:
                raw = self.engine.raw_connection()
                try:
                    raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)")
                finally:
                    raw.close()
                self.engine.dispose()
            except Exception as exc:  # best effort: the refusal below is what matters
                _log.warning("could not settle the write-ahead log of %s: %s", self._file, exc)
        raise StoreUnavailable(
            f"The session database file {str(self._file)!r} was {what} while the app had it open. "
            "Nothing was changed. Restart the app to use the file now at that path."
        )

    def _is_transient(self, exc: DBAPIError) -> bool:
        if self.dialect == "sqlite":
            text = str(exc.orig).lower()
            return "database is locked" in text or "database is busy" in text or "database table is locked" in text
        return getattr(exc.orig, "sqlstate", None) in _PG_RETRY_SQLSTATES

    def _transaction(self, work: Callable[[Connection], T], *, write: bool) -> T:
        """Run ``work(conn)`` in one transaction, retrying lock/serialization conflicts."""
        delay = 0.02
        if self.dialect == "sqlite":
            self._check_file(settle=True)
        for attempt in range(1, self._max_attempts + 1):
            try:
                with self.engine.connect() as conn:
                    if self.dialect == "sqlite":
                        conn.execution_options(explorer_sqlite_begin="BEGIN IMMEDIATE" if write else "BEGIN")
                    with conn.begin():
                        if self.dialect == "sqlite":
                            self._check_file()  # under the transaction's lock (BEGIN IMMEDIATE for writes)
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
            if current > schema.SCHEMA_VERSION:
                raise StoreUnavailable(
                    f"The session database ({self.describe()}) has schema version {current}, newer than "
                    f"this app understands ({schema.SCHEMA_VERSION}). Upgrade the app; the database was not touched."
                )
            for version, description, migrate in _migrations():
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
        return self._read_back(session_id, "The session was saved")

    def _read_back(self, session_id: str, what: str) -> Session:
        """The session after a committed change. A failure now must not say "nothing was changed":
        the change is stored, and a retry of a save would make a duplicate."""
        try:
            return self.load(session_id)
        except SessionError as exc:
            raise SavedButUnreadable(session_id, what, exc) from None

    def load(self, session_id: str) -> Session:
        """The session with that id, probes included. Raises ``SessionNotFound``."""
        return self._transaction(lambda conn: session_from_row(self._fetch(conn, session_id)), write=False)

    def list_sessions(
        self,
        query: str = "",
        *,
        author: str | None = None,
        layer: int | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> SessionList:
        """Sessions, newest change first. ``query``: every whitespace-separated word must appear
        (case-insensitive) in the name, author, prompt text or notes; a word ``layer:N`` filters by
        layer instead (so one search box covers all). ``author``/``layer``: exact filters.
        A row that cannot be read is skipped and reported in the result's ``damaged`` list."""
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

        def work(conn: Connection) -> SessionList:
            out = SessionList()
            for row in conn.execute(stmt):
                try:
                    out.append(summary_from_row(row))
                except DamagedSession as exc:  # one bad row must not hide every other session
                    out.damaged.append(exc)
            return out

        found = self._transaction(work, write=False)
        if found.damaged:
            _log.warning("session list skipped %d damaged row(s): %s", len(found.damaged),
                         "; ".join(str(e) for e in found.damaged))
        return found

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
            current = session_from_row(row, with_probes=False).data()  # probes: kept as bytes or replaced
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
        return self._read_back(session_id, "Your change was saved")

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
        return self._read_back(session_id, "The session was restored")

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


def _migrations():
    """The package's MIGRATIONS, looked up at use (a test may replace the list on the package)."""
    return importlib.import_module(__package__).MIGRATIONS


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
