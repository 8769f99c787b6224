#!/usr/bin/env bash
# Set up everything the tests need (packages, chromium, PostgreSQL) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
if [[ -z "${EXPLORER_TEST_PG_URL:-}" ]]; then
  EXPLORER_TEST_PG_URL="$(bash scripts/start_postgres.sh | tail -n 1)"
  export EXPLORER_TEST_PG_URL
  trap 'bash scripts/start_postgres.sh stop >/dev/null 2>&1 || true' EXIT
fi
# two workers (CI's two cores; the suite's torch computes on one thread a process), each test file whole on one
# worker (its module fixtures built once): ~16.5 minutes serially on the CI-sized machine
python3 -m pytest -q -n 2 --dist loadfile "$@"
