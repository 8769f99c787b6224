"""Database fixtures for the session-store tests: a real SQLite file and a real PostgreSQL server.

Import the fixtures into a test module (``from pg_fixture import db_url, pg_server_url, pg_url``).

PostgreSQL: ``EXPLORER_TEST_PG_URL`` names a server (any database on it; its user must be allowed to
CREATE DATABASE). Without it, ``scripts/start_postgres.sh`` starts (or reuses) a local server on
127.0.0.1:55432; a server the fixture started is stopped at the end of the run. Each test gets its
own freshly created database, dropped afterwards. When no server can be had, tests FAIL under
``CI=true`` and skip (with the reason) elsewhere.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
START_SCRIPT = ROOT / "scripts" / "start_postgres.sh"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _no_postgres(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"PostgreSQL is required under CI=true but unavailable: {reason}", pytrace=False)
    pytest.skip(f"no PostgreSQL server: {reason} (set EXPLORER_TEST_PG_URL or run scripts/start_postgres.sh)")


def _server_answers(url: str) -> bool:
    engine = sa.create_engine(url, connect_args={"connect_timeout": 2}, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return True
    except sa.exc.SQLAlchemyError:
        return False
    finally:
        engine.dispose()


def _with_psycopg(url: str) -> str:
    parsed = make_url(url)
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_server_url():
    """URL of a running PostgreSQL server (admin connection, any database)."""
    given = os.environ.get("EXPLORER_TEST_PG_URL")
    if given:
        url = _with_psycopg(given)
        if not _server_answers(url):
            _no_postgres(f"EXPLORER_TEST_PG_URL={make_url(url).render_as_string(hide_password=True)} does not answer")
        yield url
        return

    default_url = "postgresql+psycopg://explorer@127.0.0.1:55432/explorer_test"
    started_here = False
    if _server_answers(default_url):
        url = default_url
    else:
        try:
            proc = subprocess.run(
                ["bash", str(START_SCRIPT)], capture_output=True, text=True, timeout=600, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            _no_postgres(f"{START_SCRIPT.name} could not run: {exc}")
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            _no_postgres(f"{START_SCRIPT.name} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
        url = lines[-1].strip()
        started_here = True
        if not _server_answers(url):
            _no_postgres(f"{START_SCRIPT.name} printed {url} but it does not answer")
    yield url
    if started_here:
        subprocess.run(["bash", str(START_SCRIPT), "stop"], capture_output=True, timeout=120, check=False)


@pytest.fixture
def pg_url(pg_server_url):
    """A fresh, empty PostgreSQL database for one test; dropped afterwards."""
    name = "explorer_t_" + secrets.token_hex(6)
    admin = sa.create_engine(pg_server_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))  # name is ours: hex only
    except sa.exc.SQLAlchemyError as exc:
        admin.dispose()
        _no_postgres(f"cannot create a test database: {str(getattr(exc, 'orig', exc)).strip()}")
    url = make_url(pg_server_url).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path):
    """A SQLite file in the test's temp folder (not in memory: several connections must share it)."""
    return f"sqlite:///{tmp_path / 'sessions.sqlite3'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """The same test against a real SQLite file and a real PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sessions.sqlite3'}"
    return request.getfixturevalue("pg_url")
