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
# hgxserve/ is the agent, which runs on the host's own python3: Ubuntu 22.04's 3.10 and later
echo "==> vermin (hgxserve runs on Python 3.10)"
.venv/bin/vermin -q --no-tips --violations --eval-annotations --target=3.10- hgxserve
echo "==> pytest"
.venv/bin/pytest -q -p no:cacheprovider --timeout 900 "$@"
