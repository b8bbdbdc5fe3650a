#!/usr/bin/env bash
# The built-in demo on a fresh machine: set up .venv, boot 3 local test hosts, start a local S3
# with a tiny model, deploy baseline -> P/D -> back to baseline, print each step, tear down.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-packages.sh
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
