#!/usr/bin/env bash
# Create .venv with hgxserve and its pinned dependencies, and .venv-aiperf with the bench's load
# generator, at once (idempotent, fast when up to date).
#
#   bash scripts/setup.sh           .venv with the [dev,bench] extras: the tests (scripts/test.sh)
#   bash scripts/setup.sh --demo    .venv with the [demo] extra only: what scripts/demo.sh runs
#
# The two venvs do not depend on each other (AIPerf's pins conflict with ours, pyproject.toml
# dependency group `aiperf`), so they install side by side; `hgxserve bench` finds AIPerf as
# .venv/bin/aiperf.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
extras="dev,bench"
if [ "${1:-}" = "--demo" ]; then
  extras="demo"
fi
digest=$(sha256sum pyproject.toml | cut -c1-16)

main_venv() {
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  # the full set (tests) also serves the demo
  for stamp in ".venv/.hgxserve-deps.$digest.$extras" ".venv/.hgxserve-deps.$digest.dev,bench"; do
    [ -e "$stamp" ] && return 0
  done
  local started=$SECONDS
  echo "==> installing hgxserve[$extras] and its pinned dependencies into .venv"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e ".[$extras]"
  rm -f .venv/.hgxserve-deps.*
  touch ".venv/.hgxserve-deps.$digest.$extras"
  echo "==> .venv ready in $((SECONDS - started)) s"
}

aiperf_venv() {
  local stamp=".venv-aiperf/.hgxserve-aiperf.$digest"
  [ -e "$stamp" ] && return 0
  local started=$SECONDS
  echo "==> installing the bench load generator (AIPerf) into .venv-aiperf"
  [ -x .venv-aiperf/bin/python ] || "$PY" -m venv .venv-aiperf
  .venv-aiperf/bin/pip install -q --upgrade pip
  .venv-aiperf/bin/pip install -q --group aiperf
  rm -f .venv-aiperf/.hgxserve-aiperf.*
  touch "$stamp"
  echo "==> .venv-aiperf ready in $((SECONDS - started)) s"
}

main_venv > >(sed 's/^/[.venv] /') 2>&1 &
main=$!
aiperf_venv > >(sed 's/^/[.venv-aiperf] /') 2>&1 &
aiperf=$!
status=0
wait "$main" || status=$?
wait "$aiperf" || status=$?
[ "$status" = 0 ] || { echo "setup failed (exit $status)" >&2; exit "$status"; }
ln -sfn ../../.venv-aiperf/bin/aiperf .venv/bin/aiperf
