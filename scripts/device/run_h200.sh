#!/bin/bash
# One prepared run on a lent H200 machine: real command outputs, every fact's own command, the
# JIT cache round trip and the non-torch memory figures. Writes everything under $OUT.
#   (on the device machine, repository root)  bash scripts/device/run_h200.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
if ls "$HERE"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$HERE"/*.whl && export PYTHONPATH=/tmp/site
fi
raw=$(mktemp -d)
cap() { name=$1; shift; { echo "# command: $*"; bash -c "$*" 2>&1; echo "# rc: $?"; } >"$raw/$name.txt"; }
cap nvidia-smi nvidia-smi
cap nvidia-smi-L nvidia-smi -L
cap nvidia-smi-q nvidia-smi -q
cap topo-m nvidia-smi topo -m
cap nvlink-status nvidia-smi nvlink --status
cap nvlink-s nvidia-smi nvlink -s
cap driver-version cat /proc/driver/nvidia/version
cap lsmod "lsmod | grep -E 'nvidia|peermem'"
cap query-gpu "nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,driver_version,persistence_mode,mig.mode.current,pci.bus_id --format=csv"
cap query-compute-apps-idle "nvidia-smi --query-compute-apps=pid,used_memory --format=csv"
cap ibv_devinfo ibv_devinfo
cap fabricmanager "nv-fabricmanager --version; systemctl status nvidia-fabricmanager --no-pager"
cap os-release cat /etc/os-release
python3 "$HERE"/h200_check.py hold 20 >"$raw/hold.log" 2>&1 &
holder=$!
for _ in $(seq 1 120); do grep -q holding "$raw/hold.log" && break; sleep 0.5; done
cap nvidia-smi-with-process nvidia-smi
cap query-compute-apps "nvidia-smi --query-compute-apps=pid,used_memory --format=csv"
kill "$holder"; wait "$holder" 2>/dev/null
bash "$HERE"/facts.sh >"$OUT/facts.txt" 2>&1
tar -C "$raw" -cf "$OUT/raw.tar" .
echo "== mem"; timeout 180 python3 "$HERE"/h200_check.py mem "$OUT/mem.json" 2>&1 | tail -n 20
echo "== jit"; timeout 420 python3 "$HERE"/h200_check.py jit "$OUT/jit.json" 2>&1 | tail -n 20
ls -la "$OUT"
