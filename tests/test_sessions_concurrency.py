"""Eight writers at once, as threads sharing a store and as separate processes with their own
stores (racing the schema migration too), on SQLite and PostgreSQL: nothing lost."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import sqlalchemy as sa

from explorer.sessions import SCHEMA_VERSION, SessionStore
from pg_fixture import db_url, pg_server_url, pg_url  # noqa: F401  (fixtures)
from session_workers import APPENDS_PER_WRITER, SESSIONS_PER_WRITER, marker, process_writer, run_writer

WRITERS = 8


def assert_nothing_lost(url: str) -> None:
    with SessionStore(url) as store:
        assert store.schema_version() == SCHEMA_VERSION
        summaries = store.list_sessions(limit=10_000)
        assert len(summaries) == WRITERS * SESSIONS_PER_WRITER
        by_name = {s.name: s for s in summaries}
        for writer in range(WRITERS):
            for j in range(SESSIONS_PER_WRITER):
                name = "shared" if (writer == 0 and j == 0) else f"w{writer}-{j}"
                session = store.load(by_name[name].id)
                assert session.author == f"w{writer}" and session.layer == j
                assert session.prompts == [f"prompt {writer} {j}"]
                assert session.tab == f"tab-{writer}-{j}"
                assert session.probes == {"tokens": [str(writer), str(j)], "layers": {}}

        shared = store.load(by_name["shared"].id)
        expected = [marker(w, k) for w in range(WRITERS) for k in range(APPENDS_PER_WRITER)]
        assert sorted(m + "]" for m in shared.notes.split("]")[:-1]) == sorted(expected)
        assert shared.revision == 2 + WRITERS * APPENDS_PER_WRITER  # save, tab edit, every append

    engine = sa.create_engine(url)
    with engine.connect() as conn:
        versions = [r[0] for r in conn.execute(sa.text("SELECT version FROM explorer_schema_version"))]
    engine.dispose()
    assert sorted(versions) == list(range(1, SCHEMA_VERSION + 1))  # each migration ran exactly once


@pytest.mark.timeout(120)
def test_eight_writer_threads_lose_nothing(db_url):  # noqa: F811
    barrier = threading.Barrier(WRITERS)
    errors: list[BaseException] = []

    with SessionStore(db_url) as store:
        def work(writer: int) -> None:
            try:
                run_writer(store, writer, barrier)
            except BaseException as exc:  # reported below; a thread cannot fail the test itself
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=work, args=(w,)) for w in range(WRITERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=100)
        assert not any(t.is_alive() for t in threads), "a writer thread hung"
    assert not errors, errors
    assert_nothing_lost(db_url)


@pytest.mark.timeout(180)
def test_eight_writer_processes_lose_nothing(db_url):  # noqa: F811
    ctx = multiprocessing.get_context("spawn")
    start_barrier = ctx.Barrier(WRITERS)
    barrier = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=process_writer, args=(db_url, w, start_barrier, barrier)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a writer process hung"
    assert [p.exitcode for p in procs] == [0] * WRITERS
    assert_nothing_lost(db_url)
