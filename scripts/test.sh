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
python3 -m pytest -q "$@"
