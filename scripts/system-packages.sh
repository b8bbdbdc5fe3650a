#!/usr/bin/env bash
# Debian packages the tests and the demo need on the controller (root, apt): test hosts
# (debootstrap, systemd-nspawn, ssh, ip, zstd), systemd-analyze for unit checks, graphviz for
# `hgxserve plan --diagram`, promtool (Debian's prometheus package) for the monitoring rules
# and their unit tests, nftables for the labs' one NAT rule (testbed/lab.py). Installs only what
# is missing; runs `apt-get update` only then. `--demo`: only what scripts/demo.sh needs (the
# test hosts of lab 0).
set -euo pipefail
packages=(debootstrap systemd-container systemd openssh-client iproute2 zstd)
if [ "${1:-}" != "--demo" ]; then
  packages+=(graphviz prometheus nftables)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "note: missing Debian packages (not root or no apt): ${missing[*]}" >&2
  exit 0
fi
echo "==> installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
