#!/usr/bin/env bash
# The project's test command: set up .venv, lint, type-check, run every test.
#
#   bash scripts/test.sh                 everything, as .ci/run does: the e2e tests in parallel labs
#   bash scripts/test.sh --quick         lint, types and every test not marked e2e (for iteration)
#   bash scripts/test.sh [--quick] ARGS  ARGS go to pytest (e.g. tests/proxy, -k name, -x)
#
# End-to-end tests boot real systemd-nspawn test hosts (root needed; the root filesystem is
# built once with debootstrap and cached under /var/cache/hgxserve-testbed/). Each pytest-xdist
# worker runs in a lab of its own (testbed/lab.py, tests/conftest.py): one lab per worker, their
# number from the machine's cores and memory (scripts/labs.py), or HGXSERVE_LABS=N.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi
started=$(date +%s)
phase_start=$started
phases=()
phase() { # phase NAME: the time since the last phase ended
  local now
  now=$(date +%s)
  phases+=("$1 $((now - phase_start)) s")
  phase_start=$now
}
bash scripts/system-packages.sh
bash scripts/setup.sh
phase setup
echo "==> ruff"
.venv/bin/ruff check .
echo "==> mypy"
.venv/bin/mypy hgxserve roles deploys
# hgxserve/ is the agent, which runs on the host's own python3: Ubuntu 22.04's 3.10 and later
echo "==> vermin (hgxserve runs on Python 3.10)"
.venv/bin/vermin -q --no-tips --violations --eval-annotations --target=3.10- hgxserve
phase "lint+types"
if [ "$quick" = 1 ]; then
  # CPU-bound: one worker per core
  workers=${HGXSERVE_LABS:-$(nproc)}
  echo "==> pytest, quick tier: every test not marked e2e, $workers workers"
  selection=(-m "not e2e")
else
  workers=$(.venv/bin/python scripts/labs.py)
  echo "==> pytest: $workers labs ($(.venv/bin/python scripts/labs.py --why))"
  selection=()
fi
status=0
.venv/bin/pytest -q -p no:cacheprovider --timeout 900 -n "$workers" --dist loadfile \
  --no-loadscope-reorder --durations=15 ${selection[@]+"${selection[@]}"} "$@" || status=$?
phase pytest
phases+=("total $(($(date +%s) - started)) s")
echo "==> times: $(IFS=,; echo "${phases[*]}" | sed 's/,/, /g') ($workers workers)"
exit "$status"
