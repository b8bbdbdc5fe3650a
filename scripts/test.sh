#!/usr/bin/env bash
# The project's test command: set up .venv, lint, type-check, run every test.
# End-to-end tests boot real systemd-nspawn test hosts (root needed; the root filesystem is
# built once with debootstrap and cached under /var/cache/hgxserve-testbed/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-packages.sh
bash scripts/setup.sh
echo "==> ruff"
.venv/bin/ruff check .
echo "==> mypy"
.venv/bin/mypy hgxserve roles deploys
echo "==> pytest"
.venv/bin/pytest -q -p no:cacheprovider --timeout 900 "$@"
