#!/usr/bin/env bash
# Set up and start the explorer on the shipped small model: http://localhost:8501
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m streamlit run app.py --server.headless true --browser.gatherUsageStats false "$@"
