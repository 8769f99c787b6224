"""Writers for the session-store concurrency tests (importable by spawned processes)."""

from __future__ import annotations

from explorer.sessions import SessionConflict, SessionData, SessionStore

SESSIONS_PER_WRITER = 6
APPENDS_PER_WRITER = 4


def marker(writer: int, k: int) -> str:
    return f"[w{writer}:{k}]"


def run_writer(store: SessionStore, writer: int, barrier) -> None:
    """Save own sessions, edit each once, then append markers to the one shared session.

    The shared session is writer 0's first session; appends are read-modify-write guarded by
    ``expected_revision`` and retried on conflict, so none may be lost.
    """
    own = []
    for j in range(SESSIONS_PER_WRITER):
        name = "shared" if (writer == 0 and j == 0) else f"w{writer}-{j}"
        saved = store.save(
            SessionData(name=name, author=f"w{writer}", prompts=[f"prompt {writer} {j}"], layer=j,
                        probes={"tokens": [str(writer), str(j)], "layers": {}})
        )
        own.append(saved.id)
    for j, session_id in enumerate(own):
        store.update(session_id, tab=f"tab-{writer}-{j}")

    barrier.wait(timeout=60)
    shared_id = next(s.id for s in store.list_sessions(author="w0") if s.name == "shared")
    for k in range(APPENDS_PER_WRITER):
        for _ in range(500):
            current = store.load(shared_id)
            try:
                store.set_notes(shared_id, current.notes + marker(writer, k), expected_revision=current.revision)
                break
            except SessionConflict:
                continue
        else:
            raise RuntimeError(f"writer {writer} could not append {k}")


def process_writer(url: str, writer: int, start_barrier, barrier) -> None:
    """Entry point of one writer process: its own store (and engine), opened at the same moment
    as every other writer's, so the schema migration itself is raced too."""
    start_barrier.wait(timeout=120)
    with SessionStore(url) as store:
        run_writer(store, writer, barrier)
