#!/usr/bin/env bash
# Installs what the app and its tests need on a fresh machine (Python packages; with --test also
# Debian's chromium and postgresql). Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! $PY -c "import torch, streamlit, plotly, safetensors, tokenizers, sqlalchemy, networkx, pandas, triton" 2>/dev/null \
   || ! $PY -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  $PY -m pip install --quiet --disable-pip-version-check -r requirements.txt
fi

if [[ "${1:-}" == "--test" ]]; then
  need=()
  [[ -x /usr/bin/chromium ]] || need+=(chromium)
  ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need+=(postgresql)
  if (( ${#need[@]} )); then
    SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi
