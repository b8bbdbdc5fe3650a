#!/usr/bin/env bash
# Create .venv with hgxserve and its pinned dev dependencies (idempotent, fast when up to date).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $PY"
  "$PY" -m venv .venv
fi
stamp=.venv/.hgxserve-deps.$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -e "$stamp" ]; then
  echo "==> installing hgxserve and pinned dependencies into .venv"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[dev]'
  rm -f .venv/.hgxserve-deps.*
  touch "$stamp"
fi
