#!/usr/bin/env bash
# The built-in demo on a fresh machine: set up what it needs, boot 3 local test hosts, start a
# local S3 with a tiny model, deploy baseline -> P/D -> bench -> back to baseline, print each
# step and its time, tear down.
#
# What does not depend on each other runs at once: the two venvs (scripts/setup.sh --demo)
# install while apt-get fetches the test hosts' tools and debootstrap builds their root
# filesystem (python3 -m testbed.rootfs: standard library only, cached after the first run).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
took() { echo "==> $1 in $((SECONDS - $2)) s (demo at $((SECONDS - started)) s)"; }
t=$SECONDS
bash scripts/setup.sh --demo &
venvs=$!
bash scripts/system-packages.sh --demo
took "Debian packages" "$t"
t=$SECONDS
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
status=0
"$PY" -m testbed.rootfs || status=$?
took "test hosts' root filesystem" "$t"
wait "$venvs" || status=$?
took "setup (packages, venvs, root filesystem)" 0
[ "$status" = 0 ] || exit "$status"
exec .venv/bin/python scripts/demo.py "$@"
