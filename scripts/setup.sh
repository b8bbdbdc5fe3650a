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
  .venv/bin/pip install -q -e '.[dev,bench]'
  rm -f .venv/.hgxserve-deps.*
  touch "$stamp"
fi
# The bench load generator (AIPerf) in its own venv: its pins conflict with ours (pyproject.toml,
# dependency group `aiperf`); `hgxserve bench` finds it as .venv/bin/aiperf.
astamp=.venv-aiperf/.hgxserve-aiperf.$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -e "$astamp" ]; then
  echo "==> installing the bench load generator (AIPerf) into .venv-aiperf"
  [ -x .venv-aiperf/bin/python ] || "$PY" -m venv .venv-aiperf
  .venv-aiperf/bin/pip install -q --upgrade pip
  .venv-aiperf/bin/pip install -q --group aiperf
  rm -f .venv-aiperf/.hgxserve-aiperf.*
  touch "$astamp"
fi
ln -sfn ../../.venv-aiperf/bin/aiperf .venv/bin/aiperf
