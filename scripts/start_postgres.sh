#!/usr/bin/env bash
# Start (or reuse) a throw-away PostgreSQL server for the session-store tests.
#
#   scripts/start_postgres.sh          start if needed; the LAST line of stdout is the SQLAlchemy URL
#   scripts/start_postgres.sh stop     stop the server this script started (data dir is kept)
#
# Idempotent: a server already answering on the port is reused. Installs Debian's `postgresql`
# package when no server binary is present. Listens on 127.0.0.1 only; trust auth for the local
# test user (the server holds nothing but test data and is unreachable from outside this machine).
#
# Knobs (environment): EXPLORER_PG_PORT (55432), EXPLORER_PG_DIR (/tmp/explorer-pg-$PORT),
# EXPLORER_PG_USER (explorer), EXPLORER_PG_DB (explorer_test), EXPLORER_PG_FSYNC (off; "on" for a server
# that must also survive a crash of the machine itself).
#
# Durability: synchronous_commit is ON, so every commit the server acknowledged survives an abrupt stop
# of the server (kill -9, pg_ctl -m immediate). With fsync off (the default, for a fast test suite) a crash
# of the whole machine or a power loss can still lose recent commits; EXPLORER_PG_FSYNC=on closes that too.
# (The session store also asks for synchronous_commit=on on each of its connections.)
set -euo pipefail

PORT="${EXPLORER_PG_PORT:-55432}"
PGDIR="${EXPLORER_PG_DIR:-/tmp/explorer-pg-$PORT}"
DBUSER="${EXPLORER_PG_USER:-explorer}"
DBNAME="${EXPLORER_PG_DB:-explorer_test}"
FSYNC="${EXPLORER_PG_FSYNC:-off}"
if [[ "$FSYNC" != on && "$FSYNC" != off ]]; then
    echo "start_postgres: EXPLORER_PG_FSYNC must be on or off, got '$FSYNC'" >&2
    exit 2
fi
FULL_PAGE_WRITES="$FSYNC"   # torn pages only matter when fsync is on
DATA="$PGDIR/data"
SOCK="$PGDIR/sock"
LOG="$PGDIR/server.log"

log() { echo "start_postgres: $*" >&2; }

find_bindir() {
    local candidate
    # newest major version first
    for candidate in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k4 -V -r); do
        if [[ -x "$candidate/postgres" && -x "$candidate/initdb" && -x "$candidate/pg_ctl" ]]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

BINDIR="$(find_bindir || true)"
if [[ -z "$BINDIR" ]]; then
    if [[ "$(id -u)" != 0 ]]; then
        log "PostgreSQL is not installed and this user cannot apt-get install it (run as root, or: sudo apt-get install -y postgresql)"
        exit 2
    fi
    log "installing Debian's postgresql package"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq postgresql >&2
    BINDIR="$(find_bindir || true)"
    if [[ -z "$BINDIR" ]]; then
        log "apt-get install postgresql finished but no /usr/lib/postgresql/*/bin/postgres was found"
        exit 2
    fi
fi

# postgres refuses to run as root: run the server as the `postgres` system user in that case
# (the Debian package creates it).
if [[ "$(id -u)" == 0 ]]; then
    RUNAS=postgres
    if ! id "$RUNAS" >/dev/null 2>&1; then
        useradd --system --home-dir "$PGDIR" --shell /usr/sbin/nologin "$RUNAS"
    fi
    as_pg() { runuser -u "$RUNAS" -- "$@"; }
else
    RUNAS="$(id -un)"
    as_pg() { "$@"; }
fi

if [[ "${1:-start}" == stop ]]; then
    if [[ -f "$DATA/postmaster.pid" ]]; then
        as_pg "$BINDIR/pg_ctl" -D "$DATA" -m fast -w stop >&2 || true
    else
        log "no server running from $DATA"
    fi
    exit 0
fi

URL="postgresql+psycopg://$DBUSER@127.0.0.1:$PORT/$DBNAME"

ready() { "$BINDIR/pg_isready" -q -h 127.0.0.1 -p "$PORT" -t 1; }

mkdir -p "$PGDIR"
if [[ "$(id -u)" == 0 ]]; then
    chown "$RUNAS" "$PGDIR"
    chmod 700 "$PGDIR"
fi

if ready; then
    log "a server already answers on 127.0.0.1:$PORT; reusing it"
else
    if [[ ! -f "$DATA/PG_VERSION" ]]; then
        log "initdb into $DATA"
        as_pg "$BINDIR/initdb" -D "$DATA" -U "$DBUSER" --auth=trust --encoding=UTF8 --locale=C.UTF-8 --no-sync >&2 \
            || { rm -rf "$DATA"; as_pg "$BINDIR/initdb" -D "$DATA" -U "$DBUSER" --auth=trust --encoding=UTF8 --locale=C --no-sync >&2; }
    fi
    as_pg mkdir -p "$SOCK"
    # A stale pid file (server killed with the machine) would block the start.
    if [[ -f "$DATA/postmaster.pid" ]] && ! as_pg "$BINDIR/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
        rm -f "$DATA/postmaster.pid"
    fi
    log "starting PostgreSQL ($BINDIR) on 127.0.0.1:$PORT"
    # synchronous_commit on: an acknowledged save is in the WAL before the client hears "saved"
    # (off lost 8 of 60 acknowledged saves when the server was stopped abruptly).
    if ! as_pg "$BINDIR/pg_ctl" -D "$DATA" -l "$LOG" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $PORT -k $SOCK -c fsync=$FSYNC -c synchronous_commit=on -c full_page_writes=$FULL_PAGE_WRITES -c max_connections=100" \
        start >&2; then
        log "server failed to start; last lines of $LOG:"
        tail -n 20 "$LOG" >&2 || true
        exit 3
    fi
fi

for _ in $(seq 1 50); do ready && break; sleep 0.2; done
if ! ready; then
    log "server on 127.0.0.1:$PORT does not answer"
    exit 3
fi

PSQL=("$BINDIR/psql" -X -q -h 127.0.0.1 -p "$PORT" -U "$DBUSER" -d postgres -v ON_ERROR_STOP=1 -tA)
if [[ "$("${PSQL[@]}" -c "SELECT 1 FROM pg_database WHERE datname = '$DBNAME'")" != 1 ]]; then
    "${PSQL[@]}" -c "CREATE DATABASE \"$DBNAME\"" >&2
fi

if [[ "$("${PSQL[@]}" -c "SHOW synchronous_commit")" != on ]]; then
    log "warning: the server on 127.0.0.1:$PORT runs with synchronous_commit off (an abrupt stop loses acknowledged" \
        "commits; the session store turns it on for its own connections). Restart it: $0 stop; $0"
fi

echo "$URL"
